"""A/B benchmark of ``kserve_trio/runtime/backend.py`` against its version at a git revision.

Loads the backend module of ``--baseline REV`` (``git show REV:kserve_trio/runtime/backend.py``)
next to the working tree's, builds one CPU backend from each, loads the demo ``mlp`` with each
and times ``CompiledModel.execute`` in interleaved rounds in this one process, so machine noise
(other jobs on a shared box) hits both alike -- separate processes run minutes apart disagree by
more than the effect being measured. It first checks the outputs are bit-identical. Each batch
size's interleaved rounds are one point under the clean-run rule of tools/bench/noise.py
(others' CPU and the load average over the window, this process being the load; a point where
others used over ``NOISY_CORES`` is measured again, and reported as noisy).

Usage: ``python tools/bench/backend_ab.py --baseline HEAD~1 [--rounds 40] [--iters 2000]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from noise import Window, clean_point

ROOT = Path(__file__).resolve().parents[2]


def _load_baseline(rev: str, tmp: Path):
    src = subprocess.run(
        ["git", "show", f"{rev}:kserve_trio/runtime/backend.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp / "baseline_backend.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_backend", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["baseline_backend"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", required=True, help="git revision of the 'before' backend")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args(argv)

    from kserve_trio.export.demo import write_demo_repository
    from kserve_trio.runtime import backend as current
    from kserve_trio.runtime import load_compiled_model

    tmp = tempfile.TemporaryDirectory()
    base = _load_baseline(args.baseline, Path(tmp.name))
    bundle = write_demo_repository(tmp.name, only=["mlp"])["mlp"]
    models = {
        "before": load_compiled_model(bundle, base.JaxBackend.create("cpu")),
        "after": load_compiled_model(bundle, current.JaxBackend.create("cpu")),
    }
    print(f"baseline {args.baseline}; {args.rounds} interleaved rounds x {args.iters} calls")
    print(
        "| batch | before p50 / p90 us | after p50 / p90 us | outputs bit-identical "
        "| others' cores |"
    )
    print("|---|---|---|---|---|")
    pc = time.perf_counter_ns
    for b in (int(s) for s in args.batches.split(",")):
        x = np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)
        same = np.array_equal(
            models["before"].execute(None, b, [x])[0], models["after"].execute(None, b, [x])[0]
        )

        def point(b=b, x=x) -> dict:
            samples: dict[str, list[int]] = {k: [] for k in models}
            order = list(models.items())
            window = Window([], include_self=True)
            window.start()
            for r in range(args.rounds):
                for k, m in order if r % 2 else order[::-1]:
                    for _ in range(100):
                        m.execute(None, b, [x])
                    for _ in range(args.iters):
                        t = pc()
                        m.execute(None, b, [x])
                        samples[k].append(pc() - t)
            window.stop()
            return window.record({"samples": samples})

        res = clean_point(point, f"batch {b}")
        samples = res["samples"]
        cells = []
        for k in models:
            xs = sorted(samples[k])
            cells.append(f"{xs[len(xs) // 2] / 1e3:.1f} / {xs[int(0.9 * len(xs))] / 1e3:.1f}")
        noisy = " noisy" if res.get("noisy") else ""
        print(f"| {b} | {cells[0]} | {cells[1]} | {same} | {res['others_cores']:.3f}{noisy} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
