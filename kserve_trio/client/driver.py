"""The streaming drivers: ``infer_async`` and ``infer_sync`` over an ``InferenceIO``.

A driver cuts ``range(len(io))`` into chunks of at most ``chunk`` items and, per chunk:

1. acquires ``span`` contiguous slots of the staging pool (shared memory when the route to the
   server is shared memory, the heap pool otherwise), within the chunk's deadline;
2. lets ``io.encode_chunk`` stage the inputs in the slot and, on the shared-memory path, carves
   the declared outputs (``output_specs``) after them;
3. builds the ``ModelInferRequest`` (a ``core.protocol.infer_wire`` message, encoded straight from the
   descriptors): inputs in the shared-memory pool by reference (region, offset, size), anything
   else inline in ``raw_input_contents`` as a view of its bytes (copied only into the wire
   message itself); declared outputs by reference into their carved buffers (shm) or by name
   (inline);
4. sends it: retry inside the deadline budget, wrapped in stale-registration recovery (a
   FAILED_PRECONDITION "unregistered shared memory region..." re-registers once, coalesced over
   concurrent chunks, and retries once; a second failure latches the endpoint inline and the
   same chunk is re-sent inline from the same slot, so nothing is encoded or decoded twice);
5. copies shared-memory outputs into the response (``rehydrate``) so ``InferOutput`` reads the
   same on either path, calls ``io.decode_chunk``, and always releases the slot.

``infer_sync`` runs chunks one at a time; ``infer_async`` keeps up to ``n_slots // span`` in
flight, stops starting new ones after the first error, lets the started ones finish and raises
that first error. The geometry and request building are plain functions, tested as such.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from kserve_trio.client.errors import RpcError, ShmUnrecoverableError, is_stale_registration
from kserve_trio.client.io import (
    _BOUNDS_CHECKS,
    Descriptor,
    InferenceIO,
    InferInput,
    OutputSpec,
    as_descriptors,
    bounds_checks_enabled,
    int64_param,
    output_specs,
    string_param,
)
from kserve_trio.client.loop_thread import refuse_in_event_loop
from kserve_trio.client.model import KServeModel, send_infer
from kserve_trio.client.runtime import (
    ClientState,
    EndpointState,
    Route,
    get_state,
)
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import BufferPool, ScratchBuffer, pool_offset, scratch
from kserve_trio.core.protocol import (
    SHM_BYTE_SIZE_PARAM,
    SHM_OFFSET_PARAM,
    SHM_REGION_PARAM,
    Buffer,
    InferInputTensor,
    InferOutputTensor,
    InferRequestedOutput,
    InferRequestMessage,
    InferResponseMessage,
    Params,
    ShmRef,
    byte_view,
    encode_bytes_tensor,
    raw_output_indices,
    shm_params,
)
from kserve_trio.core.tensors import dtype_from_wire, dtype_of

log = get_logger("kserve_trio.client")

PADDING_PER_BUFFER = 8
"""Alignment slack reserved per carved buffer (``scratch`` aligns to the dtype's itemsize)."""
PADDED_INPUTS = 16
"""How many input buffers the geometry reserves alignment slack for."""

_SHM_PARAMS = (SHM_REGION_PARAM, SHM_OFFSET_PARAM, SHM_BYTE_SIZE_PARAM)


# --------------------------------------------------------------------------------------------
# Pure pieces


def chunk_geometry(
    per_item: int, slot_bytes: int, n_slots: int, max_batch_size: int, padding: int = 0
) -> tuple[int, int]:
    """``(span, chunk)``: slots per chunk and items per chunk.

    1. ``per_item`` (input bytes + reserved output bytes per item) must be > 0.
    2. ``span = ceil((per_item + padding) / slot_bytes)``: the fewest slots one item fits in;
       more than ``n_slots`` is an error that says to grow the pool.
    3. ``chunk = min(max_batch_size, (span * slot_bytes - padding) // per_item)``.
    """
    if per_item <= 0:
        raise ValueError(
            f"an item needs {per_item} bytes of slot space; item_input_bytes() (plus the "
            "declared outputs on the shared-memory path) must be > 0"
        )
    span = math.ceil((per_item + padding) / slot_bytes)
    if span > n_slots:
        raise ValueError(
            f"one item needs {per_item + padding} bytes, {span} slots of {slot_bytes} bytes, "
            f"but the pool has {n_slots} slots; increase pool_bytes on kserve_init"
        )
    chunk = min(max_batch_size, (span * slot_bytes - padding) // per_item)
    return span, max(1, chunk)


def chunks(n: int, size: int) -> list[range]:
    """Consecutive ranges of at most ``size`` items covering ``range(n)``."""
    return [range(start, min(n, start + size)) for start in range(0, n, size)]


def _shm_params(region: str, offset: int, nbytes: int) -> Params:
    return shm_params(ShmRef(region, int(offset), int(nbytes)))


def build_chunk_request(
    model_name: str,
    descs: Sequence[Descriptor],
    pool: BufferPool,
    *,
    shm: bool,
    outputs: Sequence[OutputSpec] = (),
    out_bufs: Sequence[ScratchBuffer] = (),
    id: str = "",
) -> InferRequestMessage:
    """The ``ModelInferRequest`` of one chunk (no deadline parameter; the sender adds it).

    1. A ``scratch`` descriptor must come from ``pool``: with ``shm`` it is sent by reference
       (``pool.region_name``, its absolute offset, its bytes), else inline: its
       ``raw_input_contents`` entry is a memoryview of the slot, copied only when serialized.
    2. An ``InferInput`` over a view of ``pool`` is sent like a descriptor; any other array is
       sent inline, its entry a view of the array (C-contiguous arrays are not copied), or a
       ``BYTES`` input's length-prefixed encoding.
    3. Requested outputs: with ``out_bufs`` (shm), each declared output by reference into its
       buffer; else the declared outputs by name; nothing declared -> every output, inline.
    4. ``raw_input_contents`` holds the inline inputs in input order.
    """
    request = InferRequestMessage(model_name=model_name, id=id)
    seen: set[str] = set()
    for d in descs:
        if d.name in seen:
            raise ValueError(f"encode_chunk returned input '{d.name}' twice")
        seen.add(d.name)
        if isinstance(d, ScratchBuffer):
            if d.pool is not pool:
                raise ValueError(
                    f"scratch descriptor '{d.name}' was carved from another pool than the "
                    "chunk's slot"
                )
            msg = InferInputTensor(d.name, dtype_of(d.dtype).wire, d.shape)
            if shm:
                msg.parameters = _shm_params(pool.region_name, d.offset, d.nbytes)
            else:  # a view of the slot, valid while the chunk holds it (the whole send)
                request.raw_input_contents.append(pool.view(d.offset, d.nbytes))
        else:
            assert isinstance(d, InferInput)
            msg = InferInputTensor(d.name, d.datatype, d.shape)
            offset = pool_offset(pool, d.array) if shm else None
            if offset is not None:
                msg.parameters = _shm_params(pool.region_name, offset, d.nbytes)
            elif d.dtype.is_bytes:  # variable-length elements: their encoding, inline
                request.raw_input_contents.append(encode_bytes_tensor(d.array))
            else:
                request.raw_input_contents.append(byte_view(d.array))
        request.inputs.append(msg)
    if out_bufs:
        for buf in out_bufs:
            request.outputs.append(
                InferRequestedOutput(
                    buf.name, _shm_params(pool.region_name, buf.offset, buf.nbytes)
                )
            )
    else:
        for spec in outputs:
            request.outputs.append(InferRequestedOutput(spec.name))
    return request


def rehydrate(
    response: InferResponseMessage, pool: BufferPool, out_bufs: Sequence[ScratchBuffer]
) -> InferResponseMessage:
    """Copy every output the server wrote to shared memory into ``raw_output_contents`` (in
    place, before the slot is released) and strip its shm parameters, so the response reads
    like an inline one: ``raw_output_contents`` aligned with the raw-carried outputs.

    The byte count is the output's ``shared_memory_byte_size`` (fallback: wire shape x
    itemsize) and must fit the buffer reserved for it. Stock Triton writes a requested output
    to the region but answers with an empty inline entry and no shm parameters: an output we
    reserved a buffer for whose inline entry is empty is read from that buffer too.
    """
    by_name = {b.name: b for b in out_bufs}
    raw = response.raw_output_contents
    indices = raw_output_indices(response.outputs, len(raw))  # either layout, by position
    if indices is None:
        raise RpcError(
            StatusCode.INTERNAL,
            f"response from model '{response.model_name}' has {len(raw)} raw_output_contents "
            "entries, which match none of its outputs' layouts",
            method="ModelInfer",
        )
    merged: list[Buffer] = []
    for out, index in zip(response.outputs, indices, strict=True):
        region = string_param(out.parameters, SHM_REGION_PARAM)
        if region is None:
            if out.contents is None:
                entry = None if index is None else raw[index]
                buf = by_name.get(out.name)
                if buf is not None and not entry:
                    merged.append(_reserved_bytes(response, out, pool, buf))
                    continue
                if entry is None:
                    raise RpcError(
                        StatusCode.INTERNAL,
                        f"output '{out.name}' of model '{response.model_name}' has no "
                        "raw_output_contents entry",
                        method="ModelInfer",
                    )
                merged.append(entry)
            continue
        buf = by_name.get(out.name)
        if buf is None or region != pool.region_name:
            raise RpcError(
                StatusCode.INTERNAL,
                f"output '{out.name}' came back in shared memory region '{region}', which this "
                "request did not reserve for it",
                method="ModelInfer",
            )
        merged.append(_reserved_bytes(response, out, pool, buf))
        out.parameters = {k: v for k, v in out.parameters.items() if k not in _SHM_PARAMS}
    response.raw_output_contents = merged
    return response


def _reserved_bytes(
    response: InferResponseMessage,
    out: InferOutputTensor,
    pool: BufferPool,
    buf: ScratchBuffer,
) -> bytes:
    """A copy of what the server wrote to ``out``'s reserved buffer (see ``rehydrate``)."""
    nbytes = int64_param(out.parameters, SHM_BYTE_SIZE_PARAM)
    if nbytes is None:
        nbytes = math.prod(out.shape) * dtype_from_wire(out.datatype).itemsize
    if not 0 <= nbytes <= buf.nbytes:
        raise RpcError(
            StatusCode.INTERNAL,
            f"output '{out.name}' of model '{response.model_name}' reports {nbytes} bytes in "
            f"shared memory but {buf.nbytes} were reserved",
            method="ModelInfer",
        )
    return bytes(pool.view(buf.offset, nbytes))


# --------------------------------------------------------------------------------------------
# One drive


@dataclass
class _Drive:
    """Everything the chunks of one ``infer_*`` call share."""

    model: KServeModel
    io: Any
    state: ClientState
    pool: BufferPool
    route: Route
    endpoint: EndpointState
    outputs: list[OutputSpec]
    span: int
    chunk: int

    def deadline_at(self) -> float | None:
        return time.monotonic() + self.model.deadline if self.model.deadline > 0 else None


async def _plan(model: KServeModel, io: Any) -> _Drive | None:
    n = len(io)
    if n == 0:
        return None
    state = get_state()
    transport = model.transport()
    ep = model.endpoint_state()
    budget = model.deadline if model.deadline > 0 else 3600.0
    route = await state.route(ep, model.shared_memory, transport, budget)
    pool = state.shm_pool() if route is Route.SHM else state.inline_pool()
    outputs = output_specs(io)
    per_item = int(io.item_input_bytes())
    if pool.use_shm:
        per_item += sum(s.item_bytes for s in outputs)
    padding = PADDING_PER_BUFFER * (PADDED_INPUTS + len(outputs))
    span, chunk = chunk_geometry(
        per_item, pool.slot_bytes, pool.n_slots, model.max_batch_size, padding
    )
    return _Drive(model, io, state, pool, route, ep, outputs, span, chunk)


async def _run_chunk(drive: _Drive, items: range) -> None:
    deadline_at = drive.deadline_at()
    slot = await drive.pool.acquire(
        drive.span, deadline_ns=int(deadline_at * 1e9) if deadline_at is not None else 0
    )
    try:
        slot.cursor = 0
        descs = as_descriptors(drive.io.encode_chunk(items, slot))
        out_bufs: list[ScratchBuffer] = []
        if drive.pool.use_shm and drive.outputs:
            out_bufs = scratch(
                slot, [(s.name, s.shape(len(items)), s.dtype) for s in drive.outputs]
            )
        response = await _send_chunk(drive, descs, out_bufs, deadline_at)
        drive.io.decode_chunk(items, response)
    finally:
        slot.release()


async def _send_chunk(
    drive: _Drive,
    descs: list[Descriptor],
    out_bufs: list[ScratchBuffer],
    deadline_at: float | None,
) -> InferResponseMessage:
    model, pool, state, ep = drive.model, drive.pool, drive.state, drive.endpoint
    transport = model.transport()
    if pool.use_shm and state.use_shm(ep, drive.route):
        request = build_chunk_request(
            model.model_name, descs, pool, shm=True, outputs=drive.outputs, out_bufs=out_bufs
        )
        try:
            response = await _send_with_recovery(drive, transport, request, deadline_at)
            return rehydrate(response, pool, out_bufs)
        except ShmUnrecoverableError as exc:
            log.warning("shm_unrecoverable", endpoint=model.endpoint.address, error=str(exc))
            state.latch(ep)
    request = build_chunk_request(model.model_name, descs, pool, shm=False, outputs=drive.outputs)
    return await _send(model, transport, request, deadline_at)


async def _send(model: KServeModel, transport, request, deadline_at: float | None):
    if deadline_at is None:
        return await send_infer(transport, request, model.retry, 0.0)
    return await send_infer(transport, request, model.retry, 0.0, deadline_at=deadline_at)


async def _send_with_recovery(drive: _Drive, transport, request, deadline_at: float | None):
    """Send through shared memory; on a stale registration re-register once and retry once."""
    ep, state, model = drive.endpoint, drive.state, drive.model
    seen = ep.generation
    try:
        return await _send(model, transport, request, deadline_at)
    except RpcError as exc:
        if not is_stale_registration(exc):
            raise
        log.info("shm_stale_registration", endpoint=model.endpoint.address, error=exc.message)
    remaining = (deadline_at - time.monotonic()) if deadline_at is not None else 10.0
    await state.reregister(ep, transport, seen, max(remaining, 0.001))
    try:
        return await _send(model, transport, request, deadline_at)
    except RpcError as exc:
        if is_stale_registration(exc):
            raise ShmUnrecoverableError(
                f"shared memory is still unregistered on {model.endpoint.address} after "
                f"re-registering: {exc.message}"
            ) from exc
        raise


async def _drive(model: KServeModel, io: Any, max_in_flight: int | None) -> None:
    drive = await _plan(model, io)
    if drive is None:
        log.warning("empty_io", model=model.model_name)
        return
    window = max(1, drive.pool.n_slots // drive.span)
    if max_in_flight is not None:
        window = min(window, max_in_flight)
    pieces = chunks(len(io), drive.chunk)
    if window == 1 or len(pieces) == 1:
        for items in pieces:
            await _run_chunk(drive, items)
        return
    first: list[BaseException] = []
    gate = anyio.Semaphore(window)

    async def run(items: range) -> None:
        try:
            await _run_chunk(drive, items)
        except Exception as exc:
            if not first:
                first.append(exc)
        finally:
            gate.release()

    async with anyio.create_task_group() as tg:
        for items in pieces:
            await gate.acquire()
            if first:
                gate.release()
                break
            tg.start_soon(run, items)
    if first:
        raise first[0]


# --------------------------------------------------------------------------------------------
# Public entry points


def _is_io(value: Any) -> bool:
    # duck-typed: a runtime-checkable Protocol isinstance costs tens of microseconds per call
    return hasattr(value, "encode_chunk") and hasattr(value, "decode_chunk")


async def infer_async(model: KServeModel, io: InferenceIO) -> None:
    """Run ``model`` over every item of ``io``, chunks of ``max_batch_size`` items dispatched
    concurrently (bounded by the pool's slots); results go to ``io.decode_chunk``. Safe to call
    from several tasks against one model: every chunk holds its own slot."""
    if not _is_io(io):
        raise TypeError(
            f"infer_async(model, io) needs an InferenceIO, got {type(io).__name__}; for a list "
            "of InferInput use 'await model.infer(inputs)'"
        )
    await _drive(model, io, None)


async def _sync_entry(flag: bool, fn, *args):
    token = _BOUNDS_CHECKS.set(flag)
    try:
        return await fn(*args)
    finally:
        _BOUNDS_CHECKS.reset(token)


def infer_sync(model: KServeModel, inputs_or_io: Any) -> InferResponseMessage | None:
    """Blocking inference from a plain thread.

    Given a list of ``InferInput``: one inline request (with retry); returns the
    ``ModelInferResponse``. Given an ``InferenceIO``: drives it one chunk at a time and returns
    ``None``. Called on a thread running an event loop it raises ``RuntimeError`` naming the
    async alternative. The work runs on the client loop thread, whose connections and
    shared-memory registrations persist between calls.
    """
    if _is_io(inputs_or_io):
        refuse_in_event_loop("infer_sync(model, io)", "'await infer_async(model, io)'")
        return get_state().run_blocking(
            _sync_entry, bounds_checks_enabled(), _drive, model, inputs_or_io, 1
        )
    refuse_in_event_loop("infer_sync(model, inputs)", "'await model.infer(inputs)'")
    inputs = list(inputs_or_io)
    return get_state().run_blocking(_sync_entry, bounds_checks_enabled(), model.infer, inputs)


__all__ = [
    "build_chunk_request",
    "chunk_geometry",
    "chunks",
    "infer_async",
    "infer_sync",
    "pool_offset",
    "rehydrate",
]
