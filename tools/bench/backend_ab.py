"""A/B benchmark of ``kserve_trio/runtime/backend.py`` against its version at a git revision.

Loads the backend module of ``--baseline REV`` (``git show REV:kserve_trio/runtime/backend.py``)
next to the working tree's, builds one CPU backend from each, loads the demo ``mlp`` with each
and times ``CompiledModel.execute`` in interleaved rounds in this one process, so machine noise
(other jobs on a shared box) hits both alike -- separate processes run minutes apart disagree by
more than the effect being measured. It first checks the outputs are bit-identical.

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
    print("| batch | before p50 / p90 us | after p50 / p90 us | outputs bit-identical |")
    print("|---|---|---|---|")
    pc = time.perf_counter_ns
    for b in (int(s) for s in args.batches.split(",")):
        x = np.random.default_rng(b).standard_normal((b, 16)).astype(np.float32)
        same = np.array_equal(
            models["before"].execute(None, b, [x])[0], models["after"].execute(None, b, [x])[0]
        )
        samples: dict[str, list[int]] = {k: [] for k in models}
        order = list(models.items())
        for r in range(args.rounds):
            for k, m in order if r % 2 else order[::-1]:
                for _ in range(100):
                    m.execute(None, b, [x])
                for _ in range(args.iters):
                    t = pc()
                    m.execute(None, b, [x])
                    samples[k].append(pc() - t)
        cells = []
        for k in models:
            xs = sorted(samples[k])
            cells.append(f"{xs[len(xs) // 2] / 1e3:.1f} / {xs[int(0.9 * len(xs))] / 1e3:.1f}")
        print(f"| {b} | {cells[0]} | {cells[1]} | {same} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
