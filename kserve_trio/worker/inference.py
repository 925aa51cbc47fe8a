"""The worker's transport-free inference core: one request in, one encoded response out.

``InferenceCore.infer`` is what every inference transport calls (the unary gRPC handler today,
a stream or REST handler the same way): it knows nothing of gRPC, HTTP/2 or call contexts, only
a parsed request, the transport's own deadline and its named collaborators (the model
repository, the request observer, the shared-memory registry, the admission and the meta
models' scratch pool). It is also the
one place that calls the ModelInfer codec (``decode_infer_request`` / ``encode_infer_response``).

A request's path, each step once:

1. admission (``serving.admission.Admission``, built by ``worker/admission.py``): a worker that
   is shutting down answers UNAVAILABLE; one at its concurrency cap answers RESOURCE_EXHAUSTED
   and counts the shed request;
2. the request's bounds (``core.protocol.request_bounds.check_infer_request``: names, counts of inputs,
   outputs and parameters, raw contents), before anything else reads a name;
3. lookup in the model repository (empty name INVALID_ARGUMENT, unknown model or version
   NOT_FOUND), before any payload is decoded;
4. decode (shared-memory inputs are leased here; a repeated input name is refused here);
5. one validation pass (``validation.validate_request``): input names, dtypes, ranks, fixed dims, and
   the requested outputs, against the model's client-facing specs;
6. the effective deadline: the smallest of the request's own (parameters) and the transport's;
7. dispatch: the scheduler (told the inputs are validated, so it does not re-check dtype and
   shape where wire inputs are executable inputs) or a meta model's ``run`` as one device unit;
8. encode (the transport's encoder: the gRPC message, or REST's JSON and binary body);
9. always, cancellation included: the decoded request's shared-memory leases are released once,
   and the observer records the outcome once (metrics, Triton statistics, heartbeat, log).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, overload

import numpy as np
from anyio import get_cancelled_exc_class

from kserve_trio.core.bundles import Manifest
from kserve_trio.core.errors import DeadlineExceeded, Internal, NotFound, ServingError
from kserve_trio.core.memory import BufferPool
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import (
    BUNDLE_VERSION,
    SHM_REGION_PARAM,
    RequestBounds,
    RequestedOutput,
    ShmRegistryLike,
    WirePieces,
    check_infer_request,
    combine_deadlines,
    decode_infer_request,
    encode_infer_response,
    name_too_long,
    shown,
)
from kserve_trio.core.tensors import NamedTensor
from kserve_trio.serving.admission import Admission
from kserve_trio.worker import validation
from kserve_trio.worker.meta import MetaCall, run_meta
from kserve_trio.worker.registry import ModelBundle
from kserve_trio.worker.scheduler import RequestTrace

if TYPE_CHECKING:
    # The parsed ModelInfer request a transport hands over (the codec reads it; the core
    # itself reads only model_name, model_version and id).
    from kserve_trio.core.memory import ShmRegistry
    from kserve_trio.core.protocol import InferRequestMessage as ParsedInferRequest
    from kserve_trio.runtime.model import CompiledModel
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.trace_control import TraceControl
    from kserve_trio.serving.tracing import RequestSpan, Tracing
    from kserve_trio.worker.hooks import Hook
    from kserve_trio.worker.observer import RequestObserver
    from kserve_trio.worker.repository import ModelRepository

InferReply = WirePieces
"""What ``encode_infer_response`` returns and a transport sends as it is."""

_Reply = TypeVar("_Reply", covariant=True)
_R = TypeVar("_R")


class ResponseEncoder(Protocol[_Reply]):
    """How a transport's reply is written from a request's outputs: called like
    ``encode_infer_response`` (which is the gRPC one)."""

    def __call__(
        self,
        model_name: str,
        request_id: str,
        outputs: Sequence[NamedTensor],
        requested: Sequence[RequestedOutput] | None = None,
        registry: ShmRegistryLike | None = None,
        *,
        model_version: str = "",
        zero_copy: bool = False,
    ) -> _Reply: ...


class InferenceCore:
    """Serves ModelInfer requests for one worker, whatever transport carried them."""

    def __init__(
        self,
        *,
        repository: ModelRepository,
        observer: RequestObserver,
        shm_registry: ShmRegistry | None,
        admission: Admission,
        meta_pool: BufferPool | None,
        bounds: RequestBounds = EdgeLimits(),
        tracing: TraceControl | None = None,
    ) -> None:
        self._repository = repository
        self._tracing: Tracing | None = None
        if tracing is not None:
            tracing.when_started(self.trace_with)
        self._bounds = bounds
        self._scheduler = repository.scheduler
        self._observer = observer
        self._shm_registry = shm_registry
        self._admission = admission
        self._meta_pool = meta_pool

    def trace_with(self, tracing: Tracing) -> None:
        """From now on, requests go through ``tracing`` (built at start-up or turned on live)."""
        self._tracing = tracing

    @property
    def traced(self) -> bool:
        """Tracing is on in this process: transports hand ``infer`` the caller's trace
        context."""
        return self._tracing is not None

    @overload
    async def infer(
        self,
        request: ParsedInferRequest,
        *,
        transport_deadline_ns: int = 0,
        admitted: bool = False,
        trace_context: str | None = None,
        rpc: str = "ModelInfer",
        http_route: str | None = None,
        trace: RequestTrace | None = None,
    ) -> InferReply: ...

    @overload
    async def infer(
        self,
        request: ParsedInferRequest,
        *,
        transport_deadline_ns: int = 0,
        encode: ResponseEncoder[_R],
        admitted: bool = False,
        trace_context: str | None = None,
        rpc: str = "ModelInfer",
        http_route: str | None = None,
        trace: RequestTrace | None = None,
    ) -> _R: ...

    async def infer(
        self,
        request: ParsedInferRequest,
        *,
        transport_deadline_ns: int = 0,
        encode: ResponseEncoder[Any] | None = None,
        admitted: bool = False,
        trace_context: str | None = None,
        rpc: str = "ModelInfer",
        http_route: str | None = None,
        trace: RequestTrace | None = None,
    ) -> Any:
        """Serve one parsed ModelInfer request (see the module docstring for the steps).

        ``transport_deadline_ns`` is the transport's absolute ``time.monotonic_ns()`` deadline
        (gRPC's ``grpc-timeout``; 0 = none). ``encode`` writes the reply (the gRPC message by
        default; the REST adapter passes its JSON and binary encoder, called the same way).
        ``admitted``: the transport holds the request's admission slot already (a stream's
        message, ``StreamSession``), so the admission step is skipped.
        ``trace_context`` is the caller's W3C trace context (``caller_context``: gRPC metadata
        or HTTP headers), read only when tracing is on; ``rpc`` names the span (a stream's
        message: ``ModelStreamInfer``) and ``http_route`` marks a REST call (its route
        template). ``trace`` is given by the traced path, which records the request's spans
        from it afterwards (``_traced``).
        Raises the ``ServingError`` whose status the transport answers with; the observer has
        recorded the outcome by then.
        """
        if trace is None:
            if self._tracing is not None:  # the one test an untraced request pays
                return await self._traced(
                    self._tracing,
                    request,
                    transport_deadline_ns,
                    encode,
                    admitted,
                    trace_context,
                    rpc,
                    http_route,
                )
            trace = RequestTrace()
        admission, registry = self._admission, self._shm_registry
        started = time.perf_counter_ns()
        status = "UNKNOWN"
        try:
            if not admitted:
                admission.admit_inference()
            try:
                check_infer_request(request, self._bounds)
                # One coroutine from admission to encode: every frame on this path is paid
                # per request (docs/benchmarks/history.md, "Hot path", counts them).
                bundle = self._repository.lookup(request.model_name, request.model_version)
                decoded = decode_infer_request(request, registry)
                try:
                    validation.validate_request(bundle, decoded)
                    deadline = combine_deadlines(decoded.deadline_ns, transport_deadline_ns)
                    if bundle.is_meta:
                        outputs = await self._run_meta(bundle, decoded.inputs, deadline, trace)
                    else:
                        outputs = await self._scheduler.infer(
                            bundle.name,
                            decoded.inputs,
                            deadline_ns=deadline,
                            request_id=decoded.id,
                            trace=trace,
                            validated_for=bundle.manifest,
                        )
                    # looked up per call (not bound as a default) so the codec stays patchable
                    encoder = encode_infer_response if encode is None else encode
                    reply = encoder(
                        request.model_name,
                        decoded.id,
                        outputs,
                        decoded.requested_outputs,
                        registry,
                        model_version=BUNDLE_VERSION,
                        zero_copy=True,
                    )
                finally:
                    decoded.release()  # exactly once, cancelled or not
            finally:
                if not admitted:
                    admission.release_inference()
            status = "OK"
            return reply
        except ServingError as exc:
            status = exc.status.name
            raise
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            raise
        except BaseException as exc:
            status = "CANCELLED" if isinstance(exc, get_cancelled_exc_class()) else "INTERNAL"
            raise
        finally:
            model = request.model_name
            if name_too_long(model, self._bounds.max_name_bytes):  # refused: never logged whole
                model = shown(model)
            self._observer.finished(
                model,
                status,
                time.perf_counter_ns() - started,
                trace,
                request.id,
            )

    async def _traced(
        self,
        tracing: Tracing,
        request: ParsedInferRequest,
        transport_deadline_ns: int,
        encode: ResponseEncoder[Any] | None,
        admitted: bool,
        trace_context: str | None,
        rpc: str,
        http_route: str | None,
    ) -> Any:
        """Serve a request with tracing on: its server span when the trace settings sample it
        (``Tracing.begin``), then its phases as child spans from the marks the scheduler
        recorded, so the serving path itself is the untraced one."""
        start = time.monotonic_ns()
        span = tracing.begin(
            rpc,
            request.model_name,
            trace_context,
            start_mono_ns=start,
            attributes=lambda: _request_attributes(request, http_route),
        )
        trace = RequestTrace()
        if span is None:  # not sampled: the untraced path, its attributes never read
            return await self.infer(
                request,
                transport_deadline_ns=transport_deadline_ns,
                encode=encode,  # type: ignore[arg-type]
                admitted=admitted,
                trace=trace,
            )
        trace.span = span.context
        trace.subcalls = []
        status, message = "OK", ""
        try:
            with span.in_logs():
                reply = await self.infer(
                    request,
                    transport_deadline_ns=transport_deadline_ns,
                    encode=encode,  # type: ignore[arg-type]
                    admitted=admitted,
                    trace=trace,
                )
            span.set("kserve_trio.bytes_out", _reply_bytes(reply))
            return reply
        except ServingError as exc:
            status, message = exc.status.name, str(exc)
            raise
        except BaseException as exc:
            status = "CANCELLED" if isinstance(exc, get_cancelled_exc_class()) else "INTERNAL"
            message = str(exc)
            raise
        finally:
            _record_phases(span, trace, start, time.monotonic_ns())
            span.end(status, message, http=http_route is not None)

    # ---------------------------------------------------------------- meta models

    async def _run_meta(
        self,
        bundle: ModelBundle,
        inputs: list[NamedTensor],
        deadline_ns: int,
        trace: RequestTrace,
    ) -> list[NamedTensor]:
        """A meta's ``run`` as one scheduled unit on the device thread."""
        if deadline_ns and time.monotonic_ns() >= deadline_ns:
            raise DeadlineExceeded(bundle.name)
        repository, cache = self._repository, self._scheduler.cache

        def resolve(callee: str) -> tuple[CompiledModel | _Acquiring, Hook | None, Hook | None]:
            sub = repository.get(callee)
            if sub is None or sub.model is None:
                raise NotFound(f"meta model '{bundle.name}' calls '{callee}', which is not loaded")
            model = sub.model if cache is None else _Acquiring(sub.model, cache)
            return model, sub.preprocess, sub.postprocess

        call = MetaCall(
            bundle.name,
            bundle.manifest.meta_calls,
            resolve,
            deadline_ns=deadline_ns,
            pool=self._meta_pool,
        )
        run = bundle.run
        if run is None:  # registry refuses a meta bundle whose model.py registered no run
            raise Internal(f"meta model '{bundle.name}' has no run function")
        queued = time.monotonic_ns()
        started: list[int] = []

        def unit() -> list[NamedTensor]:
            started.append(time.monotonic_ns())
            return run_meta(bundle.name, run, list(inputs), call, bundle.manifest.wire_outputs)

        call.subcalls = trace.subcalls  # recorded only for a traced request
        outputs = await self._scheduler.run_on_device(unit)
        trace.enqueued_at_ns = queued
        trace.queue_ns = (started[0] - queued) if started else 0
        trace.compute_ns = int(call.subcall_seconds * 1e9)
        trace.batch_size = 0
        return outputs


def _request_attributes(
    request: ParsedInferRequest, http_route: str | None
) -> dict[str, str | int | float | bool]:
    """A traced request's own attributes, read off the parsed message: its version, id and
    rows (the first input's leading dimension), the tensor bytes it carried inline, the
    tensors it named in shared memory, and for a REST call the HTTP method and route."""
    inputs, outputs = request.inputs, request.outputs
    attrs: dict[str, str | int | float | bool] = {
        "kserve_trio.model_version": request.model_version or BUNDLE_VERSION,
        "kserve_trio.request_id": request.id,
        "kserve_trio.rows": int(inputs[0].shape[0]) if inputs and inputs[0].shape else 0,
        "kserve_trio.bytes_in": sum(memoryview(b).nbytes for b in request.raw_input_contents),
        "kserve_trio.shm_inputs": sum(SHM_REGION_PARAM in t.parameters for t in inputs),
        "kserve_trio.shm_outputs": sum(SHM_REGION_PARAM in t.parameters for t in outputs),
    }
    if http_route is not None:
        attrs["http.request.method"] = "POST"
        attrs["http.route"] = http_route
    return attrs


def _reply_bytes(reply: Any) -> int:
    """The reply's encoded length (a gRPC message's or a REST body's pieces)."""
    return sum(len(p) if p.__class__ is bytes else memoryview(p).nbytes for p in reply.pieces)


def _record_phases(span: RequestSpan, trace: RequestTrace, start: int, end: int) -> None:
    """A traced request's phases as child spans, from the scheduler's marks (0: the step did
    not happen). Rules:

    1. ``admission``: from arrival to the preprocess hook, or to the queue without one (the
       admission, bounds, lookup, decode and validation);
    2. ``preprocess`` and ``postprocess``: the hooks, where the model has them;
    3. ``queue``: from the queue to the batch's dispatch; ``execute``: the device execution
       (its compute time, from the dispatch), with the batch size it ran at, linked to the
       coalesced execution's own span (``Tracing.batch``) when the scheduler made one; a
       meta model's sub-calls are the ``execute`` span's children, one per ``call``;
    4. ``encode``: from the end of the execution (or of the postprocess hook) to the reply:
       the hand-back from the device thread and the encoding.
    """
    first = trace.preprocess_at_ns or trace.enqueued_at_ns
    if first:
        span.child("admission", start, first)
    if trace.preprocess_at_ns:
        span.child(
            "preprocess", trace.preprocess_at_ns, trace.preprocess_at_ns + trace.preprocess_ns
        )
    last = 0
    if trace.enqueued_at_ns:
        dispatched = trace.enqueued_at_ns + trace.queue_ns
        span.child("queue", trace.enqueued_at_ns, dispatched)
        if trace.compute_ns or trace.batch_size or trace.subcalls:
            # A meta's compute time is its sub-calls' sum: its run ends after the last one.
            last = max(
                dispatched + trace.compute_ns, trace.subcalls[-1].end_ns if trace.subcalls else 0
            )
            execute = span.child(
                "execute",
                dispatched,
                last,
                {"kserve_trio.batch_size": trace.batch_size},
                links=() if trace.batch_span is None else (trace.batch_span,),
            )
            for sub in trace.subcalls or ():
                execute.child(
                    sub.model,
                    sub.start_ns,
                    sub.end_ns,
                    {"kserve_trio.model": sub.model, "kserve_trio.meta_call": True},
                )
    if trace.postprocess_at_ns:
        last = trace.postprocess_at_ns + trace.postprocess_ns
        span.child("postprocess", trace.postprocess_at_ns, last)
    if last:
        span.child("encode", last, end)


class _Acquiring:
    """A sub-model as a meta's ``call`` sees it: each execution acquires its weights first
    (on the device thread, where the meta runs), like a scheduled batch does."""

    def __init__(self, model: CompiledModel, cache: WeightCache) -> None:
        self._model = model
        self._cache = cache
        self.name = model.name
        self.manifest: Manifest = model.manifest

    def batch_keys(self, variant: int | None) -> tuple[int, ...]:
        return self._model.batch_keys(variant)

    def execute(
        self, variant: int | None, batch_key: int, inputs: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        self._cache.acquire(self._model)
        return self._model.execute(variant, batch_key, inputs)


__all__ = [
    "InferReply",
    "InferenceCore",
    "ResponseEncoder",
]
