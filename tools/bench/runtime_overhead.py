"""Runtime benchmark: compile time per module and per-execution overhead of ``CompiledModel``.

Writes the demo ``mlp`` bundle (or uses ``--bundle``), then

1. loads it twice in this process -- once through the ``.jaxexport`` sidecars, once from the
   ``.mlir`` portable artifacts alone -- and reports each module's compile time (the first compile
   of the process also pays for the XLA CPU client start-up, so it is listed apart);
2. times, interleaved in rounds so machine noise hits every variant alike, at each batch size:

   * ``direct``: the same AOT-compiled executable called directly,
     ``[np.asarray(o) for o in call(x, *device_weights)]`` -- the floor;
   * ``runtime``: ``CompiledModel.execute(None, batch, [x])`` -- what the worker calls;
   * ``jit``: a native ``jax.jit`` of the same function with device weights, for reference;

   and reports p50/p90 per call and the runtime's overhead over ``direct`` (p50 difference).

Usage: ``python tools/bench/runtime_overhead.py [--iters 3000] [--rounds 5] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _time_calls(fn, n: int) -> list[float]:
    out = []
    pc = time.perf_counter_ns
    for _ in range(n):
        t = pc()
        fn()
        out.append(pc() - t)
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bundle", type=Path, help="an mlp-like bundle (default: write the demo mlp)")
    ap.add_argument("--batches", default="1,32", help="batch sizes to time (default 1,32)")
    ap.add_argument("--iters", type=int, default=3000, help="calls per variant per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = ap.parse_args(argv)

    import jax

    from kserve_trio.export.demo import mlp_fn, write_demo_repository
    from kserve_trio.runtime import JaxBackend, load_compiled_model

    tmp = None
    if args.bundle is None:
        tmp = tempfile.TemporaryDirectory()
        t0 = time.perf_counter()
        bundle = write_demo_repository(tmp.name, only=["mlp"])["mlp"]
        export_s = time.perf_counter() - t0
    else:
        bundle, export_s = args.bundle, None

    backend = JaxBackend.create("cpu")
    compile_rows = []
    models = {}
    for source, prefer in (("jaxexport", True), ("mlir", False)):
        m = load_compiled_model(bundle, backend, prefer_jaxexport=prefer)
        models[source] = m
        for (_, key), exe in sorted(m.executables.items(), key=lambda kv: kv[0][1]):
            compile_rows.append(
                {"source": exe.source, "batch": key, "ms": exe.compile_seconds * 1e3}
            )
    model = models["jaxexport"]
    weights = model._device_weights  # the same device arrays the runtime binds

    batches = [int(b) for b in args.batches.split(",")]
    results = []
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.standard_normal((b, 16)).astype(np.float32)
        call = model.executables[(None, b)].call
        jitted = jax.jit(mlp_fn).lower(x, *weights).compile()
        variants = {
            "direct": lambda call=call, x=x: [np.asarray(o) for o in call(x, *weights)],
            "runtime": lambda b=b, x=x: model.execute(None, b, [x]),
            "jit": lambda x=x, jitted=jitted: np.asarray(jitted(x, *weights)),
        }
        for fn in variants.values():  # warm up
            for _ in range(200):
                fn()
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for k, fn in variants.items():
                samples[k] += _time_calls(fn, args.iters)
        row = {"batch": b}
        for k, xs in samples.items():
            row[f"{k}_p50_us"] = _pct(xs, 0.5)
            row[f"{k}_p90_us"] = _pct(xs, 0.9)
        row["overhead_p50_us"] = row["runtime_p50_us"] - row["direct_p50_us"]
        results.append(row)

    info = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "export_s": export_s,
        "compile": compile_rows,
        "execute": results,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"jax {info['jax']}, python {info['python']}, {info['machine']}")
    if export_s is not None:
        print(f"\nexport of the demo mlp (4 batch sizes): {export_s * 1e3:.0f} ms")
    print("\n| source | batch | compile ms |\n|---|---|---|")
    for r in compile_rows:
        print(f"| {r['source']} | {r['batch']} | {r['ms']:.1f} |")
    rest = [r["ms"] for r in compile_rows[1:]]
    print(
        f"\nfirst compile (includes XLA CPU client start-up): {compile_rows[0]['ms']:.0f} ms; "
        f"the others: median {statistics.median(rest):.0f} ms"
    )
    print(
        "\n| batch | direct p50/p90 us | runtime p50/p90 us | native jit p50/p90 us | overhead p50 us |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['batch']} | {r['direct_p50_us']:.1f} / {r['direct_p90_us']:.1f} "
            f"| {r['runtime_p50_us']:.1f} / {r['runtime_p90_us']:.1f} "
            f"| {r['jit_p50_us']:.1f} / {r['jit_p90_us']:.1f} | {r['overhead_p50_us']:+.1f} |"
        )
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
