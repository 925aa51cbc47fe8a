"""An in-memory KServe V2 endpoint and a ``Transport`` that talks to it (no sockets, any anyio
backend), for the client's shared-memory, retry and driver tests.

The fake serves one model, ``scale`` (input ``x`` FP32 [-1, 4] -> output ``y`` = factor * x,
FP32 [-1, 4]), through the real codec and a real ``ShmRegistry``, so shared-memory requests are
read from and written to the client's POSIX object exactly as the worker does. Knobs make it
misbehave on purpose: forget registrations (``restart``), shed, fail registration, stall.
"""

from __future__ import annotations

import collections
from typing import Any

import anyio
import numpy as np

from kserve_trio.client.errors import RpcError
from kserve_trio.client.io import string_param
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import ServingError, StatusCode
from kserve_trio.core.memory.shm import ShmRegistry
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.codec import SHM_REGION_PARAM
from kserve_trio.core.protocol.infer_wire import parse_infer_request
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb


class FakeServer:
    """See the module docstring. ``calls`` counts RPCs by name; ``log`` keeps ModelInfer
    requests' (input shm?, budget) for assertions."""

    def __init__(self, *, same_namespace: bool | None = True, factor: float = 2.0) -> None:
        self.same_namespace = same_namespace  # None: IsSameIPCNamespace is UNIMPLEMENTED
        self.factor = factor
        self.registry = ShmRegistry()
        self.calls: collections.Counter[str] = collections.Counter()
        self.fail_register = 0  # fail this many Register calls (UNAVAILABLE)
        self.shed = 0  # answer this many ModelInfer calls RESOURCE_EXHAUSTED
        self.errors: list[RpcError] = []  # raised, in order, by the next ModelInfer calls
        self.probe_stall = 0.0  # seconds IsSameIPCNamespace sleeps
        self.stalled_probes = 0  # IsSameIPCNamespace calls that have begun such a sleep
        self.infer_delay = 0.0
        self.forget_after: int | None = None  # restart() once ModelInfer has run this many times
        self.budgets: list[float | None] = []  # timeout of each ModelInfer attempt
        self.shm_inputs = 0
        self.inline_inputs = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def restart(self) -> None:
        """Forget every registration, as a restarted worker would."""
        self.registry.close()
        self.registry = ShmRegistry()

    def close(self) -> None:
        self.registry.close()

    async def handle(self, rpc: str, request: Any, timeout: float | None) -> Any:
        self.calls[rpc] += 1
        try:
            return await getattr(self, "_" + rpc)(request, timeout)
        except ServingError as exc:
            raise RpcError(exc.status, exc.message, method=rpc) from None

    async def _IsSameIPCNamespace(self, request, timeout):
        if self.probe_stall:
            self.stalled_probes += 1
            await anyio.sleep(self.probe_stall)
        if self.same_namespace is None:
            raise RpcError(StatusCode.UNIMPLEMENTED, "IsSameIPCNamespace is not implemented")
        return pb.IsSameIpcNamespaceResponse(same=self.same_namespace)

    async def _SystemSharedMemoryRegister(self, request, timeout):
        if self.fail_register:
            self.fail_register -= 1
            raise RpcError(StatusCode.UNAVAILABLE, "register refused on purpose")
        self.registry.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def _SystemSharedMemoryUnregister(self, request, timeout):
        self.registry.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def _SystemSharedMemoryStatus(self, request, timeout):
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                n: pb.SystemSharedMemoryStatusResponseRegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
                for n, r in self.registry.status().items()
            }
        )

    async def _ModelMetadata(self, request, timeout):
        meta = pb.ModelMetadataResponseTensorMetadata
        return pb.ModelMetadataResponse(
            name="scale",
            inputs=[meta(name="x", datatype="FP32", shape=[-1, 4])],
            outputs=[meta(name="y", datatype="FP32", shape=[-1, 4])],
        )

    async def _ModelInfer(self, request, timeout):
        self.budgets.append(timeout)
        if self.shed:
            self.shed -= 1
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "server is at its concurrency cap")
        if self.errors:
            raise self.errors.pop(0)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.infer_delay:
                await anyio.sleep(self.infer_delay)
            decoded = codec.decode_infer_request(request, self.registry)
            with decoded:
                (x,) = decoded.inputs
                if any(string_param(t.parameters, SHM_REGION_PARAM) for t in request.inputs):
                    self.shm_inputs += 1
                else:
                    self.inline_inputs += 1
                y = (x.data * np.float32(self.factor)).astype(np.float32)
                out = NamedTensor("y", DType.F32, tuple(y.shape), y)
                reply = codec.encode_infer_response(
                    request.model_name, decoded.id, [out], decoded.requested_outputs, self.registry
                )
        finally:
            self.in_flight -= 1
        if self.forget_after is not None and self.calls["ModelInfer"] >= self.forget_after:
            self.forget_after = None
            self.restart()
        return reply


_REQUEST_TYPES = {"IsSameIPCNamespace": "IsSameIpcNamespaceRequest"}


class FakeTransport:
    """A ``Transport`` to a ``FakeServer``: messages go through bytes both ways."""

    def __init__(self, endpoint: Endpoint, server: FakeServer) -> None:
        self.endpoint = endpoint
        self.server = server
        self.closed = False

    async def unary(self, method, request, reply_type, *, timeout=None, metadata=None):
        rpc = method.rsplit("/", 1)[-1]
        if timeout is not None and timeout <= 0:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", method=rpc)
        if rpc == "ModelInfer":  # parsed as the worker parses it
            parsed = parse_infer_request(bytes(request))
        else:
            request_type = getattr(pb, _REQUEST_TYPES.get(rpc, rpc + "Request"))
            parsed = request_type.FromString(bytes(request))
        try:
            with anyio.fail_after(timeout):
                reply = await self.server.handle(rpc, parsed, timeout)
        except TimeoutError:
            raise RpcError(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded", method=rpc) from None
        except RpcError as exc:
            exc.method = rpc
            raise
        await anyio.lowlevel.checkpoint()
        return reply_type.FromString(bytes(reply))

    async def aclose(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


def factory_for(server: FakeServer):
    """A ``transport_factory`` whose transports all reach ``server``."""
    return lambda endpoint: FakeTransport(endpoint, server)


class ScaleIO:
    """An ``InferenceIO`` over ``n`` items of 4 floats for the fake ``scale`` model."""

    def __init__(self, n: int, *, declare_outputs: bool = False) -> None:
        self.x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        self.y = np.full((n, 4), np.nan, dtype=np.float32)
        self.declare_outputs = declare_outputs
        self.decoded: list[range] = []

    def __len__(self) -> int:
        return len(self.x)

    def item_input_bytes(self) -> int:
        return 16

    def encode_chunk(self, items, slot):
        from kserve_trio.client import pool_view, scratch

        desc = scratch(slot, "x", (len(items), 4), np.float32)
        pool_view(desc)[...] = self.x[items.start : items.stop]
        return desc

    def decode_chunk(self, items, response) -> None:
        from kserve_trio.client import InferOutput

        self.y[items.start : items.stop] = InferOutput("y", response)
        self.decoded.append(items)

    def output_specs(self):
        from kserve_trio.client import OutputSpec

        return [OutputSpec("y", np.float32, (4,))] if self.declare_outputs else []
