#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU: a short CUDA smoke of the runtime (compile,
# run, free, memory_stats, numerics) and then every `gpu`-marked test of runtime and export.
#
#   tools/device_check.sh            # uses .venv/bin/python (needs jax[cuda12]: pip install -e '.[cuda]')
#   PYTHON=python3 tools/device_check.sh
#
# Exit status: 0 all good, 1 a check failed, 2 no usable GPU / no CUDA jax.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "device_check: nvidia-smi not found: this machine has no NVIDIA GPU" >&2
  exit 2
fi
nvidia-smi -L

"$PY" - <<'PYEOF'
import sys
import tempfile
import time

import numpy as np

import jax

from kserve_trio.core.errors import ConfigError
from kserve_trio.export.demo import cnn_reference, mlp_reference, write_demo_repository
from kserve_trio.runtime import JaxBackend, compile_count, load_compiled_model
from kserve_trio.runtime.backend import tf32_capable

ok = True


def check(cond, what):
    global ok
    print(("ok   " if cond else "FAIL ") + what)
    ok = ok and bool(cond)


try:  # first, so the allocator settings apply before jax starts its backends
    be = JaxBackend.create("cuda", allow_cpu_fallback=False, preallocate=False, mem_fraction=0.5)
except ConfigError as exc:
    print(f"device_check: no usable CUDA backend ({exc}); install '.[cuda]'", file=sys.stderr)
    sys.exit(2)
print(f"jax {jax.__version__}: CUDA devices {jax.devices('cuda')}")
check(be.platform == "cuda", f"backend on {be.device} (numerics {be.numerics.mode})")
cc = getattr(be.device, "compute_capability", "?")
print(f"compute capability {cc}, tf32 {tf32_capable(be.device)}")

with tempfile.TemporaryDirectory() as root:
    repo = write_demo_repository(root, only=["mlp", "cnn"])
    stats0 = be.memory_stats()
    check("bytes_in_use" in stats0 and stats0.get("bytes_limit", 0) > 0, f"memory_stats {stats0}")
    c0 = compile_count()
    t0 = time.perf_counter()
    mlp = load_compiled_model(repo["mlp"], be)
    cnn = load_compiled_model(repo["cnn"], be)
    check(compile_count() - c0 == 7, f"7 modules compiled once each in {time.perf_counter() - t0:.2f}s")
    sources = {e.source for m in (mlp, cnn) for e in m.executables.values()}
    print(f"module sources: {sorted(sources)} (cpu-exported sidecars fall back to .mlir on cuda)")
    rng = np.random.default_rng(0)
    for n in mlp.batch_keys(None):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        (y,) = mlp.execute(None, n, [x])
        err = float(np.abs(y - mlp_reference(x)).max())
        check(err < 2e-2, f"mlp batch {n}: max abs err {err:.2e} (auto numerics may use TF32)")
    for n in cnn.batch_keys(None):
        x = rng.standard_normal((n, 3, 32, 32)).astype(np.float32)
        (y,) = cnn.execute(None, n, [x])
        err = float(np.abs(y - cnn_reference(x)).max())
        check(err < 2e-2, f"cnn batch {n}: max abs err {err:.2e}")
    used = be.memory_stats()["bytes_in_use"]
    mlp.free_weights()
    cnn.free_weights()
    freed = used - be.memory_stats()["bytes_in_use"]
    check(not mlp.weights_resident(), f"weights freed ({freed} bytes returned to the allocator)")
    mlp.load_weights()
    (y,) = mlp.execute(None, 1, [np.ones((1, 16), np.float32)])
    check(np.allclose(y, mlp_reference(np.ones((1, 16), np.float32)), atol=2e-2), "reload + execute")

    f32 = JaxBackend.create("cuda", numerics="f32", allow_cpu_fallback=False)
    m32 = load_compiled_model(repo["mlp"], f32)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    err = float(np.abs(m32.execute(None, 32, [x])[0] - mlp_reference(x)).max())
    n_hi = sum(e.numerics.set_highest for e in m32.executables.values())
    check(err < 1e-5 and n_hi > 0, f"numerics f32: {n_hi} ops at HIGHEST, max abs err {err:.2e}")
    try:
        JaxBackend.create("cuda", numerics="tf32", allow_cpu_fallback=False)
        check(tf32_capable(be.device), "numerics tf32 accepted on a TF32 GPU")
    except ConfigError as exc:
        check(not tf32_capable(be.device), f"numerics tf32 refused: {exc}")

sys.exit(0 if ok else 1)
PYEOF

"$PY" -m pytest -m gpu tests/runtime tests/export -q -rs -p no:cacheprovider
