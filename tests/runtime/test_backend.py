"""JaxBackend: settings and numerics planning (pure), compile, weights, memory accounting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.runtime import _xla
from kserve_trio.runtime import backend as be_mod
from kserve_trio.runtime.backend import (
    JaxBackend,
    compile_count,
    free_weights,
    transfer_to_device,
)
from kserve_trio.runtime.settings import (
    NumericsPlan,
    numerics_token,
    plan_jax_settings,
    plan_numerics,
    tf32_capable,
)

from .conftest import mlp_fn, rand

SCALE4 = """
module @scale4 {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""

# ---------------------------------------------------------------------------- numerics planning


def test_numerics_modes_resolve_per_hardware():
    assert plan_numerics("auto", tf32_capable=True) == NumericsPlan("auto", False, False)
    assert plan_numerics("auto", tf32_capable=False) == NumericsPlan("auto", False, True)
    assert plan_numerics("f32", tf32_capable=True) == NumericsPlan("f32", True, False)
    assert plan_numerics("f32", tf32_capable=False) == NumericsPlan("f32", True, False)
    assert plan_numerics("tf32", tf32_capable=True) == NumericsPlan("tf32", False, False)


def test_tf32_refuses_hardware_without_tf32():
    with pytest.raises(ConfigError) as info:
        plan_numerics("tf32", tf32_capable=False, device="cpu device TFRT_CPU_0")
    assert info.value.path == "runtime.numerics"
    assert (
        "'tf32' requires a GPU with TF32 (compute capability >= 8.0); cpu device TFRT_CPU_0 "
        "has none" in str(info.value)
    )


def test_numerics_token_accepts_enums_and_rejects_unknown_modes():
    from kserve_trio.core.process.config import NumericsMode

    assert numerics_token(NumericsMode.F32) == "f32"
    assert numerics_token("TF32") == "tf32"
    with pytest.raises(ConfigError, match=r"runtime.numerics: unknown numerics mode 'bf16'"):
        numerics_token("bf16")


def test_tf32_capability_needs_an_ampere_or_newer_gpu():
    assert tf32_capable(SimpleNamespace(platform="gpu", compute_capability="8.0"))
    assert tf32_capable(SimpleNamespace(platform="gpu", compute_capability="9.0"))
    assert not tf32_capable(SimpleNamespace(platform="gpu", compute_capability="7.5"))
    assert not tf32_capable(SimpleNamespace(platform="gpu"))
    assert not tf32_capable(jax.devices("cpu")[0])


# ---------------------------------------------------------------------------- settings planning


def test_cpu_settings_pin_the_platform_and_emit_no_gpu_flags():
    s = plan_jax_settings(backend="cpu", autotune=False, autotune_cache_dir="/x", preallocate=False)
    assert dict(s.config) == {"jax_platforms": "cpu"}
    assert s.env == {} and s.xla_flags == ()


def test_cuda_settings_carry_allocator_and_autotune_knobs():
    s = plan_jax_settings(backend="cuda", mem_fraction=0.5, preallocate=False, autotune=False)
    assert s.env == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    assert s.xla_flags == ("--xla_gpu_autotune_level=0",)
    assert "jax_platforms" not in s.config  # cuda may fall back to the CPU


@pytest.mark.parametrize(
    ("cache", "cache_dir", "flags", "xla_caches"),
    [
        (None, "", (), None),
        (False, "/c", (), "none"),
        (None, "/c", ("--xla_gpu_per_fusion_autotune_cache_dir=/c",), "none"),
        (True, "/c", ("--xla_gpu_per_fusion_autotune_cache_dir=/c",), "none"),
        (True, "", (), None),
    ],
)
def test_autotune_cache_settings(cache, cache_dir, flags, xla_caches):
    s = plan_jax_settings(backend="gpu", autotune_cache=cache, autotune_cache_dir=cache_dir)
    assert s.xla_flags == flags
    assert s.config.get("jax_persistent_cache_enable_xla_caches") == xla_caches


def test_cache_dir_is_the_persistent_compilation_cache():
    s = plan_jax_settings(backend="cpu", cache_dir="/var/cache/kt")
    assert s.config["jax_compilation_cache_dir"] == "/var/cache/kt"
    assert s.config["jax_persistent_cache_min_compile_time_secs"] == 0.0
    assert s.config["jax_persistent_cache_min_entry_size_bytes"] == -1


def test_bad_backend_and_mem_fraction_are_config_errors():
    with pytest.raises(ConfigError, match=r"runtime.backend: unknown backend 'tpu'"):
        plan_jax_settings(backend="tpu")
    with pytest.raises(ConfigError, match=r"runtime.mem_fraction: must be in \(0, 1\], got 1.5"):
        plan_jax_settings(backend="cuda", mem_fraction=1.5)


# ---------------------------------------------------------------------------- creation


def test_create_cpu_backend(backend):
    assert backend.platform == "cpu"
    assert backend.device.platform == "cpu"
    assert backend.numerics == NumericsPlan("auto", False, True)


def test_create_refuses_tf32_on_cpu():
    with pytest.raises(ConfigError, match=r"runtime.numerics: 'tf32' requires a GPU with TF32"):
        JaxBackend.create("cpu", numerics="tf32")


def test_create_refuses_an_out_of_range_device_ordinal():
    n = len(jax.devices("cpu"))
    with pytest.raises(ConfigError) as info:
        JaxBackend.create("cpu", device_ordinal=n)
    assert info.value.path == "runtime.device_ordinal"
    assert f"device {n} requested but {n} cpu device(s) are visible" in str(info.value)


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="needs a machine without GPU")
def test_cuda_without_gpu_falls_back_or_refuses():
    fallback = JaxBackend.create("cuda", allow_cpu_fallback=True)
    assert fallback.platform == "cpu"
    with pytest.raises(ConfigError, match=r"runtime.backend: 'cuda' requested but no CUDA device"):
        JaxBackend.create("cuda", allow_cpu_fallback=False)


def test_from_config_reads_a_runtime_config():
    from kserve_trio.core.process.config import NumericsMode, RuntimeConfig

    cfg = RuntimeConfig(backend="cpu", numerics=NumericsMode.F32, cpu_device_memory_bytes=1 << 20)
    b = JaxBackend.from_config(cfg, "")
    assert b.platform == "cpu"
    assert b.numerics.mode == "f32"
    assert b.memory_stats()["bytes_limit"] == 1 << 20


# ---------------------------------------------------------------------------- compile and run


def test_compile_module_counts_and_runs(backend):
    before = compile_count()
    exe = backend.compile_module(SCALE4.encode(), name="scale4")
    assert compile_count() == before + 1
    assert exe.source == "mlir" and exe.n_args == 2
    assert exe.arg_shapes == (((4,), np.dtype(np.float32)),) * 2
    w = backend.transfer_to_device([np.full(4, 2, np.float32)])
    (y,) = backend.execute(exe, [np.arange(4, dtype=np.float32)], w)
    np.testing.assert_array_equal(y, [0, 2, 4, 6])


def test_f32_numerics_rewrites_before_compiling():
    b = JaxBackend.create("cpu", numerics="f32")
    exp = jax.export.export(jax.jit(mlp_fn), platforms=("cpu",))(
        *[jax.ShapeDtypeStruct(s, np.float32) for s in [(2, 16), (16, 64), (64,), (64, 8), (8,)]]
    )
    exe = b.compile_module(exp.mlir_module_serialized, name="mlp")
    assert exe.numerics.set_highest == 2
    sidecar = b.compile_exported(exp.serialize(), name="mlp")
    assert sidecar is not None and sidecar.source == "jaxexport"
    assert sidecar.numerics.set_highest == 2


def test_compile_exported_declines_other_platforms_without_compiling(backend):
    specs = [jax.ShapeDtypeStruct((4,), np.float32)] * 2
    multi = jax.export.export(jax.jit(lambda x, w: x * w), platforms=("cpu", "cuda"))(*specs)
    gpu_only = jax.export.export(jax.jit(lambda x, w: x * w), platforms=("cuda",))(*specs)
    before = compile_count()
    assert backend.compile_exported(multi.serialize(), name="m") is None
    assert backend.compile_exported(gpu_only.serialize(), name="g") is None
    assert compile_count() == before


def test_compile_exported_declines_a_signature_mismatch(backend):
    specs = [jax.ShapeDtypeStruct((4,), np.float32)] * 2
    exp = jax.export.export(jax.jit(lambda x, w: x * w), platforms=("cpu",))(*specs)
    other = _xla.entry_signature(SCALE4.replace("4xf32", "5xf32"))
    before = compile_count()
    assert backend.compile_exported(exp.serialize(), name="x", signature=other) is None
    assert compile_count() == before
    assert backend.compile_exported(
        exp.serialize(), name="x", signature=_xla.entry_signature(SCALE4)
    )
    assert compile_count() == before + 1


# ---------------------------------------------------------------------------- weights and memory


def _aligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` at a 64-byte-aligned address (what jax's CPU client would adopt)."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    off = -raw.ctypes.data % 64
    out = raw[off : off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == 0
    return out


def test_weights_transfer_once_and_free_explicitly(backend):
    hosts = [_aligned(rand((256, 256))), _aligned(rand((256,)))]
    nbytes = sum(h.nbytes for h in hosts)
    base = backend.memory_in_use()
    bufs = transfer_to_device(backend, hosts)
    assert [b.shape for b in bufs] == [(256, 256), (256,)]
    assert all(backend.device in b.devices() for b in bufs)
    assert backend.memory_in_use() - base == nbytes
    for h in hosts:
        h[...] = 7.0  # the device copy must not see host writes (jax may adopt aligned buffers)
    assert float(np.asarray(bufs[0]).max()) != 7.0 and float(np.asarray(bufs[1]).max()) != 7.0
    free_weights(backend, bufs)
    assert all(b.is_deleted() for b in bufs)
    assert backend.memory_in_use() == base
    backend.free_weights(bufs)  # freeing twice is harmless
    assert transfer_to_device(backend, []) == []


def test_memory_stats_on_cpu_report_live_arrays_and_the_configured_limit():
    b = JaxBackend.create("cpu", cpu_device_memory_bytes=123456)
    stats = b.memory_stats()
    assert stats["bytes_limit"] == 123456
    bufs = b.transfer_to_device([rand((1000,))])
    assert b.memory_stats()["bytes_in_use"] - stats["bytes_in_use"] == 4000
    b.free_weights(bufs)


@pytest.mark.slow
def test_cache_dir_enables_the_persistent_compilation_cache(tmp_path):
    script = textwrap.dedent(
        f"""
        from kserve_trio.runtime import JaxBackend
        b = JaxBackend.create("cpu", cache_dir={str(tmp_path)!r})
        b.compile_module({SCALE4!r}.encode(), name="scale4")
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=120)
    assert any(p.is_file() for p in tmp_path.rglob("*")), "no cache entry written"


def test_module_exposes_seed_spellings():
    assert be_mod.transfer_to_device is transfer_to_device
    assert be_mod.free_weights is free_weights


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_backend_compiles_runs_frees_and_reports_memory():
    # a fresh interpreter: jax's platform choice is process-wide, and CPU backends created by
    # earlier tests limit this one to the CPU
    run_fresh(
        f"""
        import numpy as np
        from kserve_trio.core.errors import ConfigError
        from kserve_trio.runtime import JaxBackend
        from kserve_trio.runtime.settings import tf32_capable
        b = JaxBackend.create("cuda", allow_cpu_fallback=False, preallocate=False)
        assert b.platform == "cuda"
        exe = b.compile_module({SCALE4!r}.encode(), name="scale4")
        base = b.memory_stats()["bytes_in_use"]
        w = b.transfer_to_device([np.full(1 << 20, 2, np.float32)])
        stats = b.memory_stats()
        assert stats["bytes_in_use"] - base >= 4 << 20 and stats["bytes_limit"] > 0, stats
        (y,) = b.execute(exe, [np.arange(4, dtype=np.float32)], [w[0][:4]])
        np.testing.assert_array_equal(y, [0, 2, 4, 6])
        b.free_weights(w)
        assert w[0].is_deleted()
        assert b.memory_stats()["bytes_in_use"] <= stats["bytes_in_use"] - (4 << 20) + 4096
        if tf32_capable(b.device):
            assert JaxBackend.create("cuda", numerics="tf32").numerics.mode == "tf32"
        else:
            try:
                JaxBackend.create("cuda", numerics="tf32")
                raise AssertionError("tf32 accepted without TF32")
            except ConfigError:
                pass
        """
    )


def run_fresh(script: str) -> str:
    """Run ``script`` in a new interpreter; fail with its output if it fails."""
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout
