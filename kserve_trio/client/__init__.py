"""kserve_trio's KServe V2 client: one-shot and streaming inference, shared memory, retries.

The public surface, stated once here (a test pins it). Every shape is row-major numpy order,
batch axis first, ``-1`` for batch and variable axes; nothing is ever reversed.

- ``KServeModel(target, port_or_model=None, model_name=None, *, ...)``: a model on an endpoint;
  ``await model.infer(inputs)`` is the async one-shot.
- ``infer_sync(model, inputs_or_io)``, ``infer_async(model, io)``: the drivers.
- ``InferInput`` (also ``InferInput.from_buffer`` / ``.from_contents``), ``InferOutput``,
  ``InferenceIO``, ``OutputSpec``, ``scratch``, ``subslot``, ``pool_view``,
  ``with_bounds_checks``: the I/O vocabulary.
- ``model_io_spec``, ``manifest_io_spec``, ``ModelIOSpec``, ``TensorMeta``, ``validate_io``.
- ``RetryPolicy``, ``BufferPool``, ``PoolAcquireTimeout``, ``kserve_init``, ``kserve_shutdown``.
- Errors: ``RpcError`` (carries ``status``), ``SharedMemoryUnavailable``,
  ``ShmUnrecoverableError``, ``IOValidationError``.
- ``Transport``, ``Endpoint``: the interface a transport implements; ``H2Transport`` (anyio
  streams + h2: asyncio and trio) implements it.
- ``client_ssl_context``: the TLS context of a ``grpcs://`` endpoint (CA bundle, client
  certificate).

This package never imports jax.
"""

from __future__ import annotations

from kserve_trio.client.driver import infer_async, infer_sync
from kserve_trio.client.errors import (
    IOValidationError,
    RpcError,
    SharedMemoryUnavailable,
    ShmUnrecoverableError,
)
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.io import (
    CheckedArray,
    InferenceIO,
    InferInput,
    InferOutput,
    OutputSpec,
    pool_view,
    scratch,
    with_bounds_checks,
)
from kserve_trio.client.model import KServeModel
from kserve_trio.client.retry import RetryPolicy
from kserve_trio.client.runtime import kserve_init, kserve_shutdown
from kserve_trio.client.spec import (
    ModelIOSpec,
    TensorMeta,
    manifest_io_spec,
    model_io_spec,
    validate_io,
)
from kserve_trio.client.tls import client_ssl_context
from kserve_trio.client.transport import Endpoint, Transport
from kserve_trio.core.errors import PoolAcquireTimeout
from kserve_trio.core.memory import BufferPool, PoolSlot, ScratchBuffer, subslot

__all__ = [
    "BufferPool",
    "CheckedArray",
    "Endpoint",
    "H2Transport",
    "IOValidationError",
    "InferInput",
    "InferOutput",
    "InferenceIO",
    "KServeModel",
    "ModelIOSpec",
    "OutputSpec",
    "PoolAcquireTimeout",
    "PoolSlot",
    "RetryPolicy",
    "RpcError",
    "ScratchBuffer",
    "SharedMemoryUnavailable",
    "ShmUnrecoverableError",
    "TensorMeta",
    "Transport",
    "client_ssl_context",
    "infer_async",
    "infer_sync",
    "kserve_init",
    "kserve_shutdown",
    "manifest_io_spec",
    "model_io_spec",
    "pool_view",
    "scratch",
    "subslot",
    "validate_io",
    "with_bounds_checks",
]
