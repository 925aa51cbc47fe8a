"""A scriptable worker stand-in: a real grpclib gRPC server on its own thread and asyncio loop,
bound to any loopback address (127.0.0.1, 127.0.0.2, ...), for the worker-pool tests.

It answers the RPCs the gateway's pool makes, with raw-bytes handlers:

- ``ServerReady``: ``ready`` (after ``probe_delay`` seconds);
- ``RepositoryIndex``: ``models``, each READY (after ``index_delay``; ``indexed`` counts calls);
- ``ModelControlStatus``: ``control``;
- ``SystemSharedMemoryRegister`` / ``Unregister``: kept in ``regions`` (name -> key), or
  failing with ``register_fail_with``;
- ``ModelInfer``: the request bytes back, prefixed with ``b"reply:"`` (so a test sees that the
  gateway returns the worker's bytes untouched), after ``infer_delay`` or the ``x-sleep``
  metadata; ``x-status``/``x-message`` metadata make it fail with that status. With ``echo``
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
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from kserve_trio.serving.grpc_adapter import Limits
from kserve_trio.serving.grpc_server import GrpcServer
from kserve_trio.serving.raw import RawCall
from tests.threaded_grpc import ThreadedGrpcServer

INFER = "/inference.GRPCInferenceService/ModelInfer"


class Raw(bytes):
    """Message bytes grpclib's codec passes through unchanged."""

    def SerializeToString(self) -> bytes:
        return self

    @classmethod
    def FromString(cls, data: bytes) -> Raw:
        return cls(data)


class _Server(GrpcServer):
    """A grpclib server that remembers its connections, so ``stop`` can drop them as a dying
    process would (the kernel closes its sockets) instead of leaving them open but mute."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.protocols: list = []

    def _protocol_factory(self):
        protocol = super()._protocol_factory()
        self.protocols.append(protocol)
        return protocol


class FakeWorker(ThreadedGrpcServer):
    """See the module docstring. ``FakeWorker(host).start()`` -> ``.port``; ``.stop()`` ends it
    like a killed process: the port closes and every open connection is dropped."""

    def __init__(self, host: str = "127.0.0.1", *, ssl_context: ssl.SSLContext | None = None):
        self.host = host
        self.ssl_context = ssl_context
        self.port = 0
        self.ready = True
        self.probe_delay = 0.0
        self.index_delay = 0.0
        self.indexed = 0
        self.infer_delay = 0.0
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
        self.peers: list[tuple] = []
        self.probes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0
        self._lock = threading.Lock()

    # -- handlers ------------------------------------------------------------------------------

    def _peer(self, stream) -> None:
        with self._lock:
            self.peers.append(stream.peer.addr())

    async def _ready(self, stream) -> None:
        await stream.recv_message()
        self._peer(stream)
        with self._lock:
            self.probes += 1
        if self.probe_delay:
            await asyncio.sleep(self.probe_delay)
        await stream.send_message(Raw(bytes(pb.ServerReadyResponse(ready=self.ready))))

    async def _index(self, stream) -> None:
        request = pb.RepositoryIndexRequest.parse(await stream.recv_message())
        with self._lock:
            self.indexed += 1
        if self.index_delay:
            await asyncio.sleep(self.index_delay)
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
        await stream.send_message(Raw(bytes(pb.RepositoryIndexResponse(models=entries))))

    async def _model_ready(self, stream) -> None:
        request = pb.ModelReadyRequest.parse(await stream.recv_message())
        ready = request.name in self.models
        await stream.send_message(Raw(bytes(pb.ModelReadyResponse(ready=ready))))

    def _known(self, name: str) -> None:
        if name not in self.models and name not in self.unloaded:
            raise GRPCError(Status.NOT_FOUND, f"unknown model: {name}")

    async def _model_metadata(self, stream) -> None:
        request = pb.ModelMetadataRequest.parse(await stream.recv_message())
        self._known(request.name)
        reply = pb.ModelMetadataResponse(name=request.name, versions=["1"], platform=self.name)
        await stream.send_message(Raw(bytes(reply)))

    async def _model_config(self, stream) -> None:
        request = pb.ModelConfigRequest.parse(await stream.recv_message())
        self._known(request.name)
        reply = pb.ModelConfigResponse(
            config=pb.ModelConfig(name=request.name, platform=self.name, max_batch_size=8)
        )
        await stream.send_message(Raw(bytes(reply)))

    async def _statistics(self, stream) -> None:
        request = pb.ModelStatisticsRequest.parse(await stream.recv_message())
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
        await stream.send_message(Raw(bytes(reply)))

    async def _same_ipc(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(Raw(bytes(pb.IsSameIpcNamespaceResponse(same=self.same_ipc))))

    async def _load(self, stream, rpc: str) -> None:
        cls = pb.RepositoryModelLoadRequest if rpc == "load" else pb.RepositoryModelUnloadRequest
        request = cls.parse(await stream.recv_message())
        with self._lock:
            self.loads.append((rpc, request.model_name))
        if self.load_fail_with is not None:
            raise GRPCError(Status(self.load_fail_with[0]), self.load_fail_with[1])
        name = request.model_name
        if rpc == "load" and name in self.unloaded:
            self.unloaded.remove(name)
            self.models.append(name)
        elif rpc == "unload" and name in self.models:
            self.models.remove(name)
            self.unloaded.append(name)
        await stream.send_message(Raw(b""))

    async def _compact(self, stream) -> None:
        await stream.recv_message()
        with self._lock:
            self.compactions += 1
        reply = rc.CompactMemoryResponse(reloaded_models=1, resident_bytes_after=100)
        await stream.send_message(Raw(bytes(reply)))

    def _echo_reply(self, request: bytes) -> bytes:
        msg = pb.ModelInferRequest.parse(request)
        for t in msg.inputs:
            region = t.parameters.get("shared_memory_region")
            if region is not None and region.string_param not in self.regions:
                raise GRPCError(
                    Status.FAILED_PRECONDITION,
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

    async def _control(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(Raw(bytes(self.control)))

    async def _infer(self, stream) -> None:
        call = RawCall(stream, "ModelInfer", Limits(512 << 20, 512 << 20))
        message = await call.receive()
        assert message is not None
        request = message.data  # as it arrived: compressed ones still compressed
        meta = dict(stream.metadata or {})
        self._peer(stream)
        with self._lock:
            self.requests.append(bytes(request))
            self.encodings.append(call.encoding if message.compressed else None)
            left = None if stream.deadline is None else stream.deadline.time_remaining()
            self.deadlines.append(left)
            self.metadata.append(meta)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            delay = float(meta.get("x-sleep", self.infer_delay))
            if delay:
                await asyncio.sleep(delay)
        except asyncio.CancelledError:
            with self._lock:
                self.cancelled += 1
            raise
        finally:
            with self._lock:
                self.in_flight -= 1
        if self.fail_with is not None:
            raise GRPCError(Status(self.fail_with[0]), self.fail_with[1])
        if "x-status" in meta:
            raise GRPCError(Status(int(meta["x-status"])), meta.get("x-message", ""))
        if self.echo:
            await stream.send_message(Raw(self._echo_reply(call.plain(message))))
            return
        await stream.send_message(Raw(b"reply:" + request))

    async def _register(self, stream) -> None:
        request = pb.SystemSharedMemoryRegisterRequest.parse(await stream.recv_message())
        with self._lock:
            self.register_calls.append(request.name)
        if self.register_fail_with is not None:
            raise GRPCError(Status(self.register_fail_with[0]), self.register_fail_with[1])
        self.regions[request.name] = request.key
        await stream.send_message(Raw(b""))

    async def _unregister(self, stream) -> None:
        request = pb.SystemSharedMemoryUnregisterRequest.parse(await stream.recv_message())
        if request.name:
            self.regions.pop(request.name, None)
        else:
            self.regions.clear()
        await stream.send_message(Raw(b""))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        def handler(fn):
            return grpclib.const.Handler(fn, Cardinality.UNARY_UNARY, Raw, Raw)

        return {
            "/inference.GRPCInferenceService/ServerReady": handler(self._ready),
            "/inference.GRPCInferenceService/RepositoryIndex": handler(self._index),
            "/reactant_control.ControlService/ModelControlStatus": handler(self._control),
            INFER: handler(self._infer),
            "/inference.GRPCInferenceService/ModelReady": handler(self._model_ready),
            "/inference.GRPCInferenceService/ModelMetadata": handler(self._model_metadata),
            "/inference.GRPCInferenceService/ModelConfig": handler(self._model_config),
            "/inference.GRPCInferenceService/ModelStatistics": handler(self._statistics),
            "/inference.GRPCInferenceService/IsSameIPCNamespace": handler(self._same_ipc),
            "/inference.GRPCInferenceService/RepositoryModelLoad": handler(
                lambda stream: self._load(stream, "load")
            ),
            "/inference.GRPCInferenceService/RepositoryModelUnload": handler(
                lambda stream: self._load(stream, "unload")
            ),
            "/reactant_control.ControlService/CompactMemory": handler(self._compact),
            "/inference.GRPCInferenceService/SystemSharedMemoryRegister": handler(self._register),
            "/inference.GRPCInferenceService/SystemSharedMemoryUnregister": handler(
                self._unregister
            ),
        }

    # -- lifecycle -----------------------------------------------------------------------------

    server_class = _Server

    def servables(self) -> list[Any]:
        return [self]

    def _closing(self, server: grpclib.server.Server) -> None:
        """Drop every open connection too, as a killed process would."""
        for protocol in getattr(server, "protocols", ()):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()
