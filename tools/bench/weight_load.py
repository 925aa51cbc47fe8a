"""Memory benchmark: what an on-demand weight load costs, next to a plain memcpy.

For each weight size (default 1, 16 and 128 MB) it exports a one-weight bundle
(``y = x * w[0]``, ``w`` f32 of the given size), loads it with the weight cache enabled, and
times, interleaved in rounds:

* ``host tier``: ``WeightCache.acquire`` of a ``PINNED_SYSTEM`` model after a compaction freed
  its device copy -- the on-demand load, a host-to-device transfer from the host
  copy (private store);
* ``shared tier``: the same with the host copy in a node-shared ``/dev/shm`` region;
* ``file``: the same for an ``UNPINNED`` model, transferred from the memory-mapped weights
  file (page cache warm);
* ``memcpy``: ``np.copyto`` of the same bytes into a preallocated buffer, and ``copy``: a fresh
  ``ndarray.copy()`` (allocation + memcpy), the floors a CPU "device" transfer compares to.

Usage: ``python tools/bench/weight_load.py [--sizes 1,16,128] [--rounds 7] [--json]``
(``--backend cuda`` to time real host-to-device copies on a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np


def _bundle(root: Path, name: str, nbytes: int) -> Path:
    from kserve_trio.export import export_bundle

    w = np.arange(nbytes // 4, dtype=np.float32) % 251
    return export_bundle(
        "jax",
        lambda x, w: x * w[0],
        np.zeros((1, 4), np.float32),
        [("w", w)],
        dir=root / name,
        batch_sizes=[1],
    )


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1,16,128", help="weight sizes in MB (default 1,16,128)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--backend", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args(argv)

    import jax

    from kserve_trio.core.process import ResidencyState
    from kserve_trio.runtime import JaxBackend
    from kserve_trio.runtime.model import load_compiled_model
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.runtime.weight_store import SharedWeightStore

    sizes = [int(s) for s in args.sizes.split(",")]
    arena = 4 * (max(sizes) << 20) + (64 << 20)
    backend = JaxBackend.create(args.backend, cpu_device_memory_bytes=arena)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in sizes:
            nbytes = mb << 20
            d = _bundle(Path(tmp), f"w{mb}", nbytes)
            tag = uuid.uuid4().hex[:6]
            caches = {
                "host tier": (WeightCache(backend, arena=arena), ResidencyState.PINNED_SYSTEM),
                "shared tier": (
                    WeightCache(backend, store=SharedWeightStore(0o600), arena=arena),
                    ResidencyState.PINNED_SYSTEM,
                ),
                "file": (WeightCache(backend, arena=arena), ResidencyState.UNPINNED),
            }
            models = {}
            for label, (cache, floor) in caches.items():
                name = f"bench_{mb}mb_{label.split()[0]}_{tag}"
                model = load_compiled_model(d, backend, name=name, resident=False)
                cache.admit(model, floor)
                models[label] = model
            src = np.arange(nbytes // 4, dtype=np.float32)
            dst = np.empty_like(src)
            times: dict[str, list[float]] = {k: [] for k in (*caches, "memcpy", "copy")}
            for _ in range(args.rounds):
                for label, (cache, _) in caches.items():
                    cache.compact()
                    t = time.perf_counter()
                    cache.acquire(models[label])
                    jax.block_until_ready(models[label]._device_weights)
                    times[label].append(time.perf_counter() - t)
                t = time.perf_counter()
                np.copyto(dst, src)
                times["memcpy"].append(time.perf_counter() - t)
                t = time.perf_counter()
                src.copy()
                times["copy"].append(time.perf_counter() - t)
            for cache, _ in caches.values():
                cache.close()
            for model in models.values():
                model.close()
            row = {"mb": mb} | {k: _ms(v) for k, v in times.items()}
            rows.append(row)

    if args.json:
        print(json.dumps({"platform": backend.platform, "rows": rows}, indent=2))
        return 0
    print(
        f"# {platform.processor() or platform.machine()}, Python {sys.version.split()[0]}, "
        f"jax {jax.__version__}, backend {backend.platform}\n"
    )
    cols = ["host tier", "shared tier", "file", "memcpy", "copy"]
    print("| weights | " + " | ".join(cols) + " | host tier / memcpy |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        cells = [f"{r[c]:.2f} ms ({r['mb'] / 1024 / (r[c] / 1e3):.1f} GB/s)" for c in cols]
        ratio = r["host tier"] / r["memcpy"]
        print(f"| {r['mb']} MB | " + " | ".join(cells) + f" | {ratio:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
