"""A frame's bytes: the messages of a request and its answer as plain tuples, pickled.

A frame's body is one pickled list of records. The messages every request and its answer are
made of (``Request``, ``Done``, ``Cancel``, ``Free``, ``Ping``, ``Pong``) are each a flat tuple
of their fields, a kind number first (a nested ``Slot``, call or detail flattened into it); the
rare messages (``Hello``, ``Log``, ``Edge``, ``Ready``, ``Drain``) are pickled as themselves.
Pickling the dataclasses themselves costs several times their fields (a Python ``__reduce__``
per object, a class call per object on the reader's side), and a request crosses the channel
two or three times on each side, on the path the front ends exist to take CPU off; tuples of
ints, strings and bytes take pickle's C paths only, as the positional tuples the channel spoke
before did. The reader turns each record back into its frozen messages through ``maker`` (no
class call; a ``Request`` or ``Done`` with a ``Slot``, the commonest records, inline from
``layout_twin``, about 15% less per message than through ``maker``), sharing one ``UnaryCall``
per RPC name and one untraced ``InferCall`` and ``StreamCall``.

A frame that does not parse, or whose records are not of the shapes above, raises
``MalformedFrame``, never anything else, whatever its bytes (``tests/serving/test_ipc_framing.py``
fuzzes it).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

from kserve_trio.serving.ipc._messages import (
    Call,
    Cancel,
    Detail,
    Done,
    Drain,
    Edge,
    Free,
    Hello,
    InferCall,
    Log,
    Message,
    Ping,
    Pong,
    Ready,
    Request,
    RestCall,
    RestHead,
    Slot,
    StreamCall,
    StreamOrigin,
    UnaryCall,
    layout_twin,
    maker,
)


class MalformedFrame(ValueError):
    """A frame's bytes are not a batch of messages (a defect of the sender: both ends are
    ours)."""


# The record kinds (a record's first item); a payload in the frame and one in a slot have
# their own kinds, so each record has a fixed arity.
_REQUEST_SLOT = 1  # (kind, id, deadline_ns, call kind, call's value, position, nbytes)
_REQUEST_INLINE = 2  # (kind, id, deadline_ns, call kind, call's value, payload)
_DONE_SLOT = 3  # (kind, id, status, message, detail kind, detail's value, position, nbytes)
_DONE_INLINE = 4  # (kind, id, status, message, detail kind, detail's value, payload)
_CANCEL = 5  # (kind, id)
_FREE = 6  # (kind, slots)
_PING = 7  # (kind, seq)
_PONG = 8  # (kind, seq)

# A call's kind and its value: the RPC's name, the trace context, or a REST call's fields.
_UNARY = 0
_INFER = 1
_STREAM = 2
_REST = 3
# An answer's detail kind and its value: None, or the detail's fields.
_NO_DETAIL = 0
_ORIGIN = 1
_REST_HEAD = 2

_PICKLED_CLASSES = frozenset((Hello, Log, Edge, Ready, Drain))
"""The messages that travel as themselves (pickled by their fields, ``_messages``)."""


def encode(batch: list[Message]) -> bytes:
    """``batch`` as one frame's body."""
    records: list[object] = []
    append = records.append
    for message in batch:
        if type(message) is Request:
            call = message.call
            if type(call) is InferCall:
                call_kind, value = _INFER, call.trace_context
            elif type(call) is UnaryCall:
                call_kind, value = _UNARY, call.rpc
            elif type(call) is StreamCall:
                call_kind, value = _STREAM, call.trace_context
            elif type(call) is RestCall:
                call_kind, value = _REST, (call.method, call.path, call.query, call.headers)
            else:
                raise TypeError(f"not a call: {call!r}")
            payload = message.payload
            if isinstance(payload, Slot):
                record = (
                    _REQUEST_SLOT, message.id, message.deadline_ns, call_kind, value,
                    payload.position, payload.nbytes,
                )  # fmt: skip
            else:
                record = (
                    _REQUEST_INLINE,
                    message.id,
                    message.deadline_ns,
                    call_kind,
                    value,
                    payload,
                )
            append(record)
        elif type(message) is Done:
            detail = message.detail
            if detail is None:
                detail_kind, value = _NO_DETAIL, None
            elif type(detail) is StreamOrigin:
                detail_kind, value = _ORIGIN, (detail.model, detail.request_id)
            elif type(detail) is RestHead:
                detail_kind, value = (
                    _REST_HEAD,
                    (detail.status, detail.content_type, detail.headers),
                )
            else:
                raise TypeError(f"not a detail: {detail!r}")
            payload = message.payload
            if isinstance(payload, Slot):
                record = (
                    _DONE_SLOT, message.id, message.status, message.message, detail_kind, value,
                    payload.position, payload.nbytes,
                )  # fmt: skip
            else:
                record = (
                    _DONE_INLINE, message.id, message.status, message.message, detail_kind, value,
                    payload,
                )  # fmt: skip
            append(record)
        elif type(message) is Free:
            append((_FREE, message.slots))
        elif type(message) is Cancel:
            append((_CANCEL, message.id))
        elif type(message) is Ping:
            append((_PING, message.seq))
        elif type(message) is Pong:
            append((_PONG, message.seq))
        else:
            append(message)
    return pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)


_make_request: Callable[..., Request] = maker(Request)
_make_done: Callable[..., Done] = maker(Done)
_REQUEST_TWIN = layout_twin(Request)
_DONE_TWIN = layout_twin(Done)
_SLOT_TWIN = layout_twin(Slot)
_make_cancel: Callable[..., Cancel] = maker(Cancel)
_make_free: Callable[..., Free] = maker(Free)
_make_ping: Callable[..., Ping] = maker(Ping)
_make_pong: Callable[..., Pong] = maker(Pong)
_make_infer: Callable[..., InferCall] = maker(InferCall)
_make_stream: Callable[..., StreamCall] = maker(StreamCall)
_make_rest: Callable[..., RestCall] = maker(RestCall)
_make_origin: Callable[..., StreamOrigin] = maker(StreamOrigin)
_make_rest_head: Callable[..., RestHead] = maker(RestHead)
_UNTRACED_INFER = InferCall()
_UNTRACED_STREAM = StreamCall()
_unary_calls: dict[str, UnaryCall] = {}
"""One ``UnaryCall`` per RPC name (frozen: one instance serves every request of that RPC)."""


def decode(frame: bytes | bytearray | memoryview) -> list[Message]:
    """The messages of one frame's body; ``MalformedFrame`` when it is not one."""
    try:
        records = pickle.loads(frame)
    except Exception as exc:  # anything pickle raises on bytes it cannot load
        raise MalformedFrame(f"the frame does not unpickle: {exc!r}") from None
    if type(records) is not list:
        raise MalformedFrame(f"the frame is a {type(records).__name__}, not a list of records")
    batch: list[Message] = []
    append = batch.append
    new = object.__new__
    request_twin, done_twin, slot_twin = _REQUEST_TWIN, _DONE_TWIN, _SLOT_TWIN
    untraced_infer = _UNTRACED_INFER
    try:
        for record in records:
            if type(record) is not tuple:
                if type(record) not in _PICKLED_CLASSES:
                    raise MalformedFrame(f"a record is a {type(record).__name__}")
                append(record)
                continue
            kind = record[0]
            if kind == _REQUEST_SLOT:  # the hottest two: built inline (layout_twin)
                _, rid, deadline_ns, call_kind, value, position, nbytes = record
                slot = new(slot_twin)
                slot.position = position
                slot.nbytes = nbytes
                slot.__class__ = Slot
                request = new(request_twin)
                request.id = rid
                request.call = (
                    untraced_infer
                    if call_kind == _INFER and value is None
                    else _call(call_kind, value)
                )
                request.deadline_ns = deadline_ns
                request.payload = slot
                request.__class__ = Request
                append(request)
            elif kind == _DONE_SLOT:
                _, rid, status, text, detail_kind, value, position, nbytes = record
                slot = new(slot_twin)
                slot.position = position
                slot.nbytes = nbytes
                slot.__class__ = Slot
                done = new(done_twin)
                done.id = rid
                done.status = status
                done.message = text
                done.payload = slot
                done.detail = None if detail_kind == _NO_DETAIL else _detail(detail_kind, value)
                done.__class__ = Done
                append(done)
            elif kind == _FREE:
                _, slots = record
                append(_make_free(slots))
            elif kind == _CANCEL:
                _, rid = record
                append(_make_cancel(rid))
            elif kind == _REQUEST_INLINE:
                _, rid, deadline_ns, call_kind, value, payload = record
                append(_make_request(rid, _call(call_kind, value), deadline_ns, payload))
            elif kind == _DONE_INLINE:
                _, rid, status, text, detail_kind, value, payload = record
                detail = None if detail_kind == _NO_DETAIL else _detail(detail_kind, value)
                append(_make_done(rid, status, text, payload, detail))
            elif kind == _PING:
                _, seq = record
                append(_make_ping(seq))
            elif kind == _PONG:
                _, seq = record
                append(_make_pong(seq))
            else:
                raise MalformedFrame(f"unknown record kind {kind!r}")
    except MalformedFrame:
        raise
    except (ValueError, TypeError, IndexError) as exc:  # a record of the wrong shape
        raise MalformedFrame(f"record {len(batch)} does not parse: {exc!r}") from None
    return batch


def _call(kind: int, value) -> Call:
    if kind == _INFER:
        return _UNTRACED_INFER if value is None else _make_infer(value)
    if kind == _UNARY:
        call = _unary_calls.get(value)
        if call is None:
            if len(_unary_calls) > 256:
                _unary_calls.clear()  # a bound, should names ever vary
            call = _unary_calls[value] = UnaryCall(value)
        return call
    if kind == _STREAM:
        return _UNTRACED_STREAM if value is None else _make_stream(value)
    if kind == _REST:
        method, path, query, headers = value
        return _make_rest(method, path, query, headers)
    raise MalformedFrame(f"unknown call kind {kind!r}")


def _detail(kind: int, value) -> Detail:
    if kind == _ORIGIN:
        model, request_id = value
        return _make_origin(model, request_id)
    if kind == _REST_HEAD:
        status, content_type, headers = value
        return _make_rest_head(status, content_type, headers)
    raise MalformedFrame(f"unknown answer detail kind {kind!r}")


__all__ = ["MalformedFrame", "decode", "encode"]
