"""A scriptable worker stand-in: a real ``serving.grpc`` server on its own thread and asyncio
loop, bound to any loopback address (127.0.0.1, 127.0.0.2, ...), for the worker-pool tests.

It answers the RPCs the gateway's pool makes, with raw-bytes handlers:

- ``ServerReady``: ``ready`` (after ``probe_delay`` seconds, and once ``probe_gate``, when one
  is set, opens);
- ``RepositoryIndex``: ``models``, each READY (after ``index_delay``; ``indexed`` counts calls);
- ``ModelControlStatus``: ``control``;
- ``SystemSharedMemoryRegister`` / ``Unregister``: kept in ``regions`` (name -> key), or
  failing with ``register_fail_with``;
- ``ModelInfer``: the request bytes back, prefixed with ``b"reply:"`` (so a test sees that the
  gateway returns the worker's bytes untouched), after ``infer_delay`` or the ``x-sleep``
  metadata, and once ``infer_gate`` (when one is set) opens; ``x-status``/``x-message`` metadata make it fail with that status. With ``echo``
  set it answers a real ``ModelInferResponse`` instead: the model, the id, and each input back
  as an output of the same name (what tritonclient can read), with a ``worker`` parameter
  naming the fake's ``name``.
- ``ModelReady`` (ready iff the model is in ``models``), ``ModelMetadata`` / ``ModelConfig``
  (the model's name and ``name`` as its platform), ``ModelStatistics`` (``stats``: model ->
  inference count), ``IsSameIPCNamespace`` (``same_ipc``), ``RepositoryModelLoad`` /
  ``Unload`` (recorded in ``loads``; failing with ``load_fail_with``; a loaded model of
  ``unloaded`` becomes ready), ``CompactMemory`` (``compactions`` counts them). Models of
  ``unloaded`` are listed by RepositoryIndex(ready=false) as UNAVAILABLE and are not ready.

It records what it saw: ``requests`` (bytes), ``deadlines`` (seconds left when each ModelInfer
arrived, ``None`` without one), ``metadata``, ``peers`` (client address of each call),
``in_flight``/``max_in_flight`` and ``cancelled`` (handlers interrupted by a client reset).

``stop()`` ends it like a killed process: the port closes and every open connection drops
without a GOAWAY, which is what the pool's reconnect and UNAVAILABLE paths must handle.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc

from kserve_trio.core.errors import StatusCode
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from kserve_trio.serving.grpc import Call, GrpcError, Limits, Method, RawMessage, raw_unary
from tests.threaded_grpc import ThreadedGrpcServer

INFER = "/inference.GRPCInferenceService/ModelInfer"
LIMITS = Limits(max_recv_bytes=512 << 20, max_send_bytes=512 << 20)

Handler = Callable[[Call, RawMessage], Awaitable[bytes]]


def _peer_of(call: Call) -> Any:
    """The client's ``host:port`` of ``call``'s connection: tells connections apart."""
    return call.peer


def _remaining(call: Call) -> float | None:
    """Seconds left before the call's deadline (None without one)."""
    return None if call.deadline is None else call.deadline - anyio.current_time()


class FakeWorker(ThreadedGrpcServer):
    """See the module docstring. ``FakeWorker(host).start()`` -> ``.port``; ``.stop()`` ends it
    like a killed process: the port closes and every open connection is dropped."""

    def __init__(self, host: str = "127.0.0.1", *, ssl_context: ssl.SSLContext | None = None):
        self.host = host
        self.ssl_context = ssl_context
        self.port = 0
        self.ready = True
        self.probe_delay = 0.0
        self.probe_gate: threading.Event | None = None
        """Set to an unset Event, it holds every ServerReady (and so the prober's round) until
        the test sets it."""
        self.index_delay = 0.0
        self.indexed = 0
        self.infer_delay = 0.0
        self.infer_gate: threading.Event | None = None
        """Set to an unset Event, it holds every ModelInfer until the test sets it: a call
        that stays in flight for as long as the test needs, never for a guessed time."""
        self.fail_with: tuple[int, str] | None = None  # every ModelInfer fails with this
        self.regions: dict[str, str] = {}  # registered region name -> key
        self.register_fail_with: tuple[int, str] | None = None
        self.register_calls: list[str] = []
        self.models: list[str] = ["m"]
        self.name = f"fake-{host}"
        self.echo = False
        self.unloaded: list[str] = []
        self.stats: dict[str, int] = {}
        self.same_ipc = True
        self.loads: list[tuple[str, str]] = []
        self.load_fail_with: tuple[int, str] | None = None
        self.compactions = 0
        self.control = rc.ModelControlStatusResponse(
            residency_mode="self_managed", discipline="fifo"
        )
        self.requests: list[bytes] = []
        self.encodings: list[str | None] = []  # each ModelInfer's grpc-encoding if compressed
        self.deadlines: list[float | None] = []
        self.metadata: list[dict] = []
        self.peers: list[str] = []
        self.probes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0
        self._lock = threading.Lock()

    # -- handlers (each ``(call, message) -> reply bytes``; a GrpcError ends it with its status)

    def _peer(self, call: Call) -> None:
        with self._lock:
            self.peers.append(_peer_of(call))

    async def _ready(self, call: Call, message: RawMessage) -> bytes:
        self._peer(call)
        with self._lock:
            self.probes += 1
        if self.probe_delay:
            await anyio.sleep(self.probe_delay)
        while self.probe_gate is not None and not self.probe_gate.is_set():
            await anyio.sleep(0.005)
        return bytes(pb.ServerReadyResponse(ready=self.ready))

    async def _index(self, call: Call, message: RawMessage) -> bytes:
        request = pb.RepositoryIndexRequest.parse(bytes(call.plain(message)))
        with self._lock:
            self.indexed += 1
        if self.index_delay:
            await anyio.sleep(self.index_delay)
        entries = [
            pb.RepositoryIndexResponseModelIndex(name=m, version="1", state="READY")
            for m in self.models
        ]
        if not request.ready:
            entries += [
                pb.RepositoryIndexResponseModelIndex(
                    name=m, version="1", state="UNAVAILABLE", reason="unloaded"
                )
                for m in self.unloaded
            ]
        return bytes(pb.RepositoryIndexResponse(models=entries))

    async def _model_ready(self, call: Call, message: RawMessage) -> bytes:
        request = pb.ModelReadyRequest.parse(bytes(call.plain(message)))
        return bytes(pb.ModelReadyResponse(ready=request.name in self.models))

    def _known(self, name: str) -> None:
        if name not in self.models and name not in self.unloaded:
            raise GrpcError(StatusCode.NOT_FOUND, f"unknown model: {name}")

    async def _model_metadata(self, call: Call, message: RawMessage) -> bytes:
        request = pb.ModelMetadataRequest.parse(bytes(call.plain(message)))
        self._known(request.name)
        return bytes(
            pb.ModelMetadataResponse(name=request.name, versions=["1"], platform=self.name)
        )

    async def _model_config(self, call: Call, message: RawMessage) -> bytes:
        request = pb.ModelConfigRequest.parse(bytes(call.plain(message)))
        self._known(request.name)
        reply = pb.ModelConfigResponse(
            config=pb.ModelConfig(name=request.name, platform=self.name, max_batch_size=8)
        )
        return bytes(reply)

    async def _statistics(self, call: Call, message: RawMessage) -> bytes:
        request = pb.ModelStatisticsRequest.parse(bytes(call.plain(message)))
        names = [request.name] if request.name else sorted(self.models)
        for name in names:
            self._known(name)
        reply = pb.ModelStatisticsResponse(
            model_stats=[
                pb.ModelStatistics(
                    name=n,
                    version="1",
                    inference_count=self.stats.get(n, 0),
                    execution_count=self.stats.get(n, 0),
                    inference_stats=pb.InferStatistics(
                        success=pb.StatisticDuration(count=self.stats.get(n, 0), ns=1000)
                    ),
                )
                for n in names
            ]
        )
        return bytes(reply)

    async def _same_ipc(self, call: Call, message: RawMessage) -> bytes:
        return bytes(pb.IsSameIpcNamespaceResponse(same=self.same_ipc))

    def _load(self, rpc: str) -> Handler:
        cls = pb.RepositoryModelLoadRequest if rpc == "load" else pb.RepositoryModelUnloadRequest

        async def handle(call: Call, message: RawMessage) -> bytes:
            request = cls.parse(bytes(call.plain(message)))
            with self._lock:
                self.loads.append((rpc, request.model_name))
            if self.load_fail_with is not None:
                raise GrpcError(self.load_fail_with[0], self.load_fail_with[1])
            name = request.model_name
            if rpc == "load" and name in self.unloaded:
                self.unloaded.remove(name)
                self.models.append(name)
            elif rpc == "unload" and name in self.models:
                self.models.remove(name)
                self.unloaded.append(name)
            return b""

        return handle

    async def _compact(self, call: Call, message: RawMessage) -> bytes:
        with self._lock:
            self.compactions += 1
        return bytes(rc.CompactMemoryResponse(reloaded_models=1, resident_bytes_after=100))

    def _echo_reply(self, request: bytes) -> bytes:
        msg = pb.ModelInferRequest.parse(request)
        for t in msg.inputs:
            region = t.parameters.get("shared_memory_region")
            if region is not None and region.string_param not in self.regions:
                raise GrpcError(
                    StatusCode.FAILED_PRECONDITION,
                    f"unregistered shared memory region: {region.string_param}",
                )
        reply = pb.ModelInferResponse(
            model_name=msg.model_name,
            model_version="1",
            id=msg.id,
            parameters={"worker": pb.InferParameter(string_param=self.name)},
            outputs=[
                pb.ModelInferResponseInferOutputTensor(
                    name=t.name, datatype=t.datatype, shape=list(t.shape)
                )
                for t in msg.inputs
            ],
            raw_output_contents=list(msg.raw_input_contents),
        )
        with self._lock:
            self.stats[msg.model_name] = self.stats.get(msg.model_name, 0) + 1
        return bytes(reply)

    async def _control(self, call: Call, message: RawMessage) -> bytes:
        return bytes(self.control)

    async def _infer(self, call: Call, message: RawMessage) -> bytes:
        request = message.data  # as it arrived: compressed ones still compressed
        meta = dict(call.metadata)
        self._peer(call)
        with self._lock:
            self.requests.append(bytes(request))
            self.encodings.append(call.encoding if message.compressed else None)
            self.deadlines.append(_remaining(call))
            self.metadata.append(meta)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            delay = float(meta.get("x-sleep", self.infer_delay))
            if delay:
                await anyio.sleep(delay)
            while self.infer_gate is not None and not self.infer_gate.is_set():
                await anyio.sleep(0.005)
        except anyio.get_cancelled_exc_class():
            with self._lock:
                self.cancelled += 1
            raise
        finally:
            with self._lock:
                self.in_flight -= 1
        if self.fail_with is not None:
            raise GrpcError(self.fail_with[0], self.fail_with[1])
        if "x-status" in meta:
            raise GrpcError(int(meta["x-status"]), str(meta.get("x-message", "")))
        if self.echo:
            return self._echo_reply(bytes(call.plain(message)))
        return b"reply:" + request

    async def _register(self, call: Call, message: RawMessage) -> bytes:
        request = pb.SystemSharedMemoryRegisterRequest.parse(bytes(call.plain(message)))
        with self._lock:
            self.register_calls.append(request.name)
        if self.register_fail_with is not None:
            raise GrpcError(self.register_fail_with[0], self.register_fail_with[1])
        self.regions[request.name] = request.key
        return b""

    async def _unregister(self, call: Call, message: RawMessage) -> bytes:
        request = pb.SystemSharedMemoryUnregisterRequest.parse(bytes(call.plain(message)))
        if request.name:
            self.regions.pop(request.name, None)
        else:
            self.regions.clear()
        return b""

    # -- lifecycle -----------------------------------------------------------------------------

    stop_like_a_killed_process = True

    def methods(self) -> dict[str, Method]:
        handlers: dict[str, Handler] = {
            "/inference.GRPCInferenceService/ServerReady": self._ready,
            "/inference.GRPCInferenceService/RepositoryIndex": self._index,
            "/reactant_control.ControlService/ModelControlStatus": self._control,
            INFER: self._infer,
            "/inference.GRPCInferenceService/ModelReady": self._model_ready,
            "/inference.GRPCInferenceService/ModelMetadata": self._model_metadata,
            "/inference.GRPCInferenceService/ModelConfig": self._model_config,
            "/inference.GRPCInferenceService/ModelStatistics": self._statistics,
            "/inference.GRPCInferenceService/IsSameIPCNamespace": self._same_ipc,
            "/inference.GRPCInferenceService/RepositoryModelLoad": self._load("load"),
            "/inference.GRPCInferenceService/RepositoryModelUnload": self._load("unload"),
            "/reactant_control.ControlService/CompactMemory": self._compact,
            "/inference.GRPCInferenceService/SystemSharedMemoryRegister": self._register,
            "/inference.GRPCInferenceService/SystemSharedMemoryUnregister": self._unregister,
        }
        return {
            path: raw_unary(fn, LIMITS, path.rsplit("/", 1)[1]) for path, fn in handlers.items()
        }
