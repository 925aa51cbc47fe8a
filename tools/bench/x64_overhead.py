"""Runtime benchmark: what serving a 64-bit bundle costs per call, and that 32-bit ones pay nothing.

The runtime calls a module with an ``i64``/``u64``/``f64`` tensor inside jax's thread-local
64-bit mode (``kserve_trio.runtime.x64``); 32-bit modules are called as before. This writes two
bundles of the same shape, ``relu(x @ w + b)`` with x [B,16] and w [16,16], one in float32 and
one in float64, loads them with the process-wide jax flag off, and times interleaved rounds of

* ``f32 execute``: ``CompiledModel.execute`` of the float32 bundle (no scope);
* ``f64 execute``: ``CompiledModel.execute`` of the float64 bundle (one scope per call);
* ``f64 call``: the float64 executable's ``call`` (the compiled function in its per-call scope);
* ``f64 call in one scope``: the same compiled function unwrapped, called inside one outer scope
  that stays entered -- the same work without the per-call enter/exit.

``f64 call - f64 call in one scope`` is the scope's cost per call. It also checks that the float32
outputs are bit-identical with the process-wide 64-bit flag off and on. The interleaved rounds
are one point under the clean-run rule of tools/bench/noise.py (others' CPU and the load average
over the window, this process being the load; a point where others used over ``NOISY_CORES`` is
measured again, and reported as noisy).

Usage: ``python tools/bench/x64_overhead.py [--iters 3000] [--rounds 5] [--batch 1]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from noise import Window, clean_point


def _p50(xs: list[int]) -> float:
    return sorted(xs)[len(xs) // 2] / 1000.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from kserve_trio.export import export_bundle
    from kserve_trio.runtime import JaxBackend, load_compiled_model

    def layer(x, w, b):
        return jnp.maximum(x @ w + b, 0)

    rng = np.random.default_rng(0)
    tmp = tempfile.TemporaryDirectory()
    models = {}
    backend = JaxBackend.create("cpu")
    for dt in ("float32", "float64"):
        w = rng.standard_normal((16, 16)).astype(dt)
        b = rng.standard_normal(16).astype(dt)
        d = Path(tmp.name) / f"layer_{dt}"
        export_bundle(
            "jax",
            layer,
            np.zeros((1, 16), dt),
            [("w", w), ("b", b)],
            dir=d,
            batch_sizes=[args.batch],
        )
        models[dt] = load_compiled_model(d, backend)
    assert not jax.config.jax_enable_x64
    n = args.batch
    x32 = rng.standard_normal((n, 16)).astype(np.float32)
    x64 = x32.astype(np.float64)
    m32, m64 = models["float32"], models["float64"]
    call64 = m64.executables[(None, n)].call
    raw64 = call64.__wrapped__  # the compiled function, unscoped
    w64 = m64._device_weights
    ref32 = m32.execute(None, n, [x32])[0].copy()
    jax.config.update("jax_enable_x64", True)
    same = np.array_equal(m32.execute(None, n, [x32])[0], ref32)
    jax.config.update("jax_enable_x64", False)

    def in_one_scope(k: int) -> list[int]:
        out = []
        pc = time.perf_counter_ns
        with jax.enable_x64(True):
            for _ in range(k):
                t = pc()
                raw64(x64, *w64)
                out.append(pc() - t)
        return out

    def timed(fn, k: int) -> list[int]:
        out = []
        pc = time.perf_counter_ns
        for _ in range(k):
            t = pc()
            fn()
            out.append(pc() - t)
        return out

    variants = {
        "f32 execute": lambda k: timed(lambda: m32.execute(None, n, [x32]), k),
        "f64 execute": lambda k: timed(lambda: m64.execute(None, n, [x64]), k),
        "f64 call": lambda k: timed(lambda: call64(x64, *w64), k),
        "f64 call in one scope": in_one_scope,
    }
    for v in variants.values():
        v(300)

    def point() -> dict:
        samples: dict[str, list[int]] = {k: [] for k in variants}
        window = Window([], include_self=True)
        window.start()
        for _ in range(args.rounds):
            for k, v in variants.items():
                samples[k] += v(args.iters)
        window.stop()
        return window.record({"samples": samples})

    res = clean_point(point, "x64 variants")
    samples = res["samples"]
    print(f"jax {jax.__version__}, batch {n}, {args.rounds} x {args.iters} calls per variant")
    print(f"f32 outputs identical with the process-wide x64 flag off and on: {same}")
    print(
        f"others used {res['others_cores']:.3f} cores, load {res['load']}"
        + (" (noisy: not for a decision)" if res.get("noisy") else "")
    )
    print("| variant | p50 us |\n|---|---|")
    for k, xs in samples.items():
        print(f"| {k} | {_p50(xs):.1f} |")
    cost = _p50(samples["f64 call"]) - _p50(samples["f64 call in one scope"])
    print(f"\nper-call cost of the 64-bit scope (p50 difference): {cost:+.1f} us")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
