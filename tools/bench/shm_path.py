"""Per-request cost of the worker's shared-memory data path, in process, without the network.

One "request" is what the worker does for an input and an output in system shared memory:
``ShmRegistry.read_view`` of the input window, the model call on that input (a jitted ``x + 0``,
which, like the identity bundle, reads its input and writes a fresh output), and
``ShmRegistry.write`` of the output into the client's region. Medians over interleaved rounds,
per payload size. ``--before FILE`` loads a second ``core/memory/shm.py`` (e.g. from a
``git worktree`` of an older commit) and measures both, interleaved, for an A/B on one box. Each
payload size's rounds are one point under the clean-run rule of tools/bench/noise.py (others'
CPU and the load average over the window, this process being the load; a point where others
used over ``NOISY_CORES`` is measured again, and reported as noisy).

Usage: python tools/bench/shm_path.py [--before /tmp/base/kserve_trio/core/memory/shm.py] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import pathlib
import secrets
import statistics
import sys
import time
from types import ModuleType

import numpy as np
import posix_ipc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import Window, clean_point

SIZES = ((4096, 400), (1 << 20, 100), (64 * 3 * 224 * 224 * 4, 15))


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def make_object(size: int, fill: bytes) -> tuple[str, mmap.mmap]:
    key = f"/kt-bench-{secrets.token_hex(4)}"
    shm = posix_ipc.SharedMemory(key, posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(shm.fd, size)
    shm.close_fd()
    mm[:] = fill * size
    return key, mm


def one_round(mod: ModuleType, fn, key: str, okey: str, size: int, n: int, out: list) -> None:
    reg = mod.ShmRegistry()
    reg.register("in", key, 0, size)
    reg.register("out", okey, 0, size)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            view, release = reg.read_view("in", 0, size)
            x = np.frombuffer(view, np.float32)
            t1 = time.perf_counter()
            y = np.asarray(fn(x).block_until_ready())
            t2 = time.perf_counter()
            reg.write("out", 0, y)
            t3 = time.perf_counter()
            release()
            del view, x, y
            out.append((t1 - t0, t2 - t1, t3 - t2))
    finally:
        reg.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="", help="an older core/memory/shm.py to compare against")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import jax

    import kserve_trio.core.memory as current
    from kserve_trio.serving.process_tuning import tune_allocator

    tune_allocator()  # as the worker CLI does
    mods = {"before": load(args.before, "shm_before")} if args.before else {}
    mods["current"] = current
    fn = jax.jit(lambda a: a + 0)
    print("| payload | registry | read_view us | model us | write us | total us | others' cores |")
    print("|---|---|---|---|---|---|---|")
    for size, n in SIZES:
        key, mm = make_object(size, b"\1")
        okey, mo = make_object(size, b"\0")

        def point(key=key, okey=okey, size=size, n=n) -> dict:
            samples: dict[str, list] = {name: [] for name in mods}
            window = Window([], include_self=True)
            window.start()
            for _ in range(args.rounds):
                for name, mod in mods.items():
                    one_round(mod, fn, key, okey, size, n, samples[name])
            window.stop()
            return window.record({"samples": samples})

        try:
            res = clean_point(point, f"{size} B")
            samples = res["samples"]
        finally:
            mm.close()
            mo.close()
            posix_ipc.unlink_shared_memory(key)
            posix_ipc.unlink_shared_memory(okey)
        for name, rows in samples.items():
            med = [statistics.median(col) * 1e6 for col in zip(*rows, strict=True)]
            print(
                f"| {size} B | {name} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | "
                f"{sum(med):.1f} | {res['others_cores']:.3f}"
                f"{' noisy' if res.get('noisy') else ''} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
