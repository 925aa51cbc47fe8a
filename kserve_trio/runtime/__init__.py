"""Runtime: compiles StableHLO bundles with JAX/XLA and executes them on one device.

This package and ``kserve_trio.export`` are the only importers of jax; jax is
imported lazily, when a backend is created or a module compiled, so importing this package is
cheap. Public surface:

* ``JaxBackend`` (``create(...)``, ``from_config(runtime_cfg, cache_dir)``) and the ``Backend``
  protocol; ``Executable``; ``compile_count()``; ``transfer_to_device``/``free_weights``;
  the pure planners ``plan_numerics`` and ``plan_jax_settings`` (``runtime/settings.py``);
* ``load_compiled_model(bundle_dir, backend, *, name=None)`` -> ``CompiledModel``;
* the weights-file helpers ``read_weights_index``, ``write_weights``, ``WeightsIndex``;
* the StableHLO module questions a bundle producer asks too: ``as_portable_artifact`` (text or
  an ``ir.Module`` -> a portable artifact), ``entry_signature`` (-> ``EntrySignature`` of
  ``TensorType``) and ``check_module_signature`` (a module against its manifest and weights),
  all raising ``ModuleFormatError`` (a ``ValueError``) for an unreadable module.
"""

from __future__ import annotations

from kserve_trio.runtime._xla import (
    EntrySignature,
    ModuleFormatError,
    TensorType,
    as_portable_artifact,
    entry_signature,
)
from kserve_trio.runtime.backend import (
    Backend,
    Executable,
    JaxBackend,
    compile_count,
    free_weights,
    transfer_to_device,
)
from kserve_trio.runtime.model import CompiledModel, check_module_signature, load_compiled_model
from kserve_trio.runtime.settings import JaxSettings, NumericsPlan, plan_jax_settings, plan_numerics
from kserve_trio.runtime.weights import WeightsIndex, read_weights_index, write_weights

__all__ = [
    "Backend",
    "CompiledModel",
    "EntrySignature",
    "Executable",
    "JaxBackend",
    "JaxSettings",
    "ModuleFormatError",
    "NumericsPlan",
    "TensorType",
    "WeightsIndex",
    "as_portable_artifact",
    "check_module_signature",
    "compile_count",
    "entry_signature",
    "free_weights",
    "load_compiled_model",
    "plan_jax_settings",
    "plan_numerics",
    "read_weights_index",
    "transfer_to_device",
    "write_weights",
]
