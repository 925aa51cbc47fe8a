"""A frame's bytes: the compact encoding of the per-request messages, pickle for the rest.

A frame's body is its messages' records, one after another. Each record begins with a byte
naming its kind; the messages every request and its answer are made of (``Request``, ``Done``,
``Cancel``, ``Free``, ``Ping``, ``Pong``) are a ``struct`` header of integers, the lengths of
their strings (UTF-8) and their strings, then the payload's bytes when it travels in the
frame; any other message (``Hello``, ``Log``, ``Edge``, ``Ready``, ``Drain``) is a pickle of
it, length-prefixed. Pickling a ``Request`` costs several times its fields (the class call per
nested object and pickle's own machinery), and a request crosses the channel two or three
times on each side, on the path the front ends exist to take CPU off; the compact records
cost about what the positional tuples the channel spoke before cost.

The reader builds the frozen messages through ``maker`` (no class call) and checks every
length against the frame: a frame that does not parse raises ``MalformedFrame``, never
anything else, whatever its bytes (``tests/serving/test_ipc_framing.py`` fuzzes it). A message
the compact record cannot hold (an integer over 64 bits, say) travels pickled instead.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from struct import Struct
from typing import Any

from kserve_trio.serving.ipc._messages import (
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
    Payload,
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
    maker,
)


class MalformedFrame(ValueError):
    """A frame's bytes are not a batch of messages (a defect of the sender: both ends are
    ours)."""


# Record kinds (the first byte of a record).
_REQUEST = 1
_DONE = 2
_CANCEL = 3
_FREE = 4
_PING = 5
_PONG = 6
_PICKLED = 7

# What a Request's call is (Request header) and what a Done's detail is (Done header).
_UNARY = 0
_INFER = 1
_INFER_TRACED = 2
_STREAM = 3
_STREAM_TRACED = 4
_REST = 5
_NO_DETAIL = 0
_ORIGIN = 1
_REST_HEAD = 2

_INLINE = -1
"""The payload position of a payload carried in the frame (a ``Slot``'s is never negative)."""

# kind, call, id, deadline_ns, payload position (_INLINE: in the frame), payload bytes, strings
_REQUEST_HEAD = Struct("<BBqqqQH")
# kind, detail, id, status, REST status, payload position, payload bytes, strings
_DONE_HEAD = Struct("<BBqiiqQH")
_ID = Struct("<Bq")  # Cancel, Ping, Pong
_COUNT = Struct("<BI")  # Free (then its slots), a pickled message (then its bytes)
_LENGTHS = [Struct(f"<{n}I") for n in range(16)]
_SLOTS = [Struct(f"<{n}q") for n in range(16)]

_ERRORS = "surrogatepass"
"""Strings round-trip as they are, lone surrogates included (a header decoded leniently)."""

_PICKLED_CLASSES = (Hello, Log, Edge, Ready, Drain, Request, Done, Cancel, Free, Ping, Pong)


def _lengths(n: int) -> Struct:
    return _LENGTHS[n] if n < 16 else Struct(f"<{n}I")


def _slots(n: int) -> Struct:
    return _SLOTS[n] if n < 16 else Struct(f"<{n}q")


def encode(batch: list[Message]) -> bytes:
    """``batch`` as one frame's body."""
    parts: list[bytes] = []
    append = parts.append
    for message in batch:
        cls = message.__class__
        try:
            if cls is Request:
                _encode_request(message, append)  # type: ignore[arg-type]
            elif cls is Done:
                _encode_done(message, append)  # type: ignore[arg-type]
            elif cls is Free:
                slots = message.slots  # type: ignore[union-attr]
                append(_COUNT.pack(_FREE, len(slots)) + _slots(len(slots)).pack(*slots))
            elif cls is Cancel:
                append(_ID.pack(_CANCEL, message.id))  # type: ignore[union-attr]
            elif cls is Ping:
                append(_ID.pack(_PING, message.seq))  # type: ignore[union-attr]
            elif cls is Pong:
                append(_ID.pack(_PONG, message.seq))  # type: ignore[union-attr]
            else:
                _encode_pickled(message, append)
        except (struct.error, UnicodeError, AttributeError, TypeError):
            _encode_pickled(message, append)  # a value the compact record cannot hold
    return b"".join(parts)


def _encode_pickled(message: Message, append: Callable[[bytes], None]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    append(_COUNT.pack(_PICKLED, len(data)))
    append(data)


def _encode_strings(strings: list[str], append: Callable[[bytes], None]) -> None:
    encoded = [s.encode("utf-8", _ERRORS) for s in strings]
    append(_lengths(len(encoded)).pack(*map(len, encoded)))
    parts = b"".join(encoded)
    if parts:
        append(parts)


def _encode_request(message: Request, append: Callable[[bytes], None]) -> None:
    call = message.call
    cls = call.__class__
    if cls is InferCall or cls is StreamCall:
        context = call.trace_context  # type: ignore[union-attr]
        if context is None:
            kind, strings = (_INFER if cls is InferCall else _STREAM), None
        else:
            kind, strings = (_INFER_TRACED if cls is InferCall else _STREAM_TRACED), [context]
    elif cls is UnaryCall:
        kind, strings = _UNARY, [call.rpc]
    elif cls is RestCall:
        kind = _REST
        strings = [call.method, call.path, call.query]  # type: ignore[union-attr]
        for name, value in call.headers.items():  # type: ignore[union-attr]
            strings += (name, value)
    else:
        raise TypeError(f"not a call: {call!r}")
    payload = message.payload
    inline = payload.__class__ is not Slot
    if inline:
        position, nbytes = _INLINE, len(payload)  # type: ignore[arg-type]
    else:
        position, nbytes = payload.position, payload.nbytes  # type: ignore[union-attr]
    count = len(strings) if strings else 0
    append(
        _REQUEST_HEAD.pack(_REQUEST, kind, message.id, message.deadline_ns, position, nbytes, count)
    )
    if strings:
        _encode_strings(strings, append)
    if inline and nbytes:
        append(payload)  # type: ignore[arg-type]


def _encode_done(message: Done, append: Callable[[bytes], None]) -> None:
    detail = message.detail
    text = message.message
    rest_status = 0
    if detail is None:
        kind = _NO_DETAIL
        strings = [text] if text else None
    elif detail.__class__ is StreamOrigin:
        kind, strings = _ORIGIN, [text, detail.model, detail.request_id]  # type: ignore[union-attr]
    elif detail.__class__ is RestHead:
        kind = _REST_HEAD
        rest_status = detail.status  # type: ignore[union-attr]
        strings = [text, detail.content_type]  # type: ignore[union-attr]
        for name, value in detail.headers:  # type: ignore[union-attr]
            strings += (name, value)
    else:
        raise TypeError(f"not a detail: {detail!r}")
    payload = message.payload
    inline = payload.__class__ is not Slot
    if inline:
        position, nbytes = _INLINE, len(payload)  # type: ignore[arg-type]
    else:
        position, nbytes = payload.position, payload.nbytes  # type: ignore[union-attr]
    count = len(strings) if strings else 0
    append(
        _DONE_HEAD.pack(
            _DONE, kind, message.id, message.status, rest_status, position, nbytes, count
        )
    )
    if strings:
        _encode_strings(strings, append)
    if inline and nbytes:
        append(payload)  # type: ignore[arg-type]


_make_request: Callable[..., Request] = maker(Request)
_make_done: Callable[..., Done] = maker(Done)
_make_slot: Callable[..., Slot] = maker(Slot)
_make_cancel: Callable[..., Cancel] = maker(Cancel)
_make_free: Callable[..., Free] = maker(Free)
_make_ping: Callable[..., Ping] = maker(Ping)
_make_pong: Callable[..., Pong] = maker(Pong)
_UNTRACED = {_INFER: InferCall(), _STREAM: StreamCall()}
_unary_calls: dict[str, UnaryCall] = {}
"""One ``UnaryCall`` per RPC name (frozen: one instance serves every request of that RPC)."""


def decode(frame: bytes | bytearray | memoryview) -> list[Message]:
    """The messages of one frame's body; ``MalformedFrame`` when it is not one."""
    view = memoryview(frame)
    end = len(view)
    offset = 0
    batch: list[Message] = []
    append = batch.append
    try:
        while offset < end:
            kind = view[offset]
            if kind == _REQUEST:
                message, offset = _decode_request(view, offset, end)
            elif kind == _DONE:
                message, offset = _decode_done(view, offset, end)
            elif kind == _CANCEL:
                message = _make_cancel(_ID.unpack_from(view, offset)[1])
                offset += _ID.size
            elif kind == _FREE:
                count = _COUNT.unpack_from(view, offset)[1]
                offset += _COUNT.size
                slots = _slots(count)
                message = _make_free(slots.unpack_from(view, offset))
                offset += slots.size
            elif kind == _PING:
                message = _make_ping(_ID.unpack_from(view, offset)[1])
                offset += _ID.size
            elif kind == _PONG:
                message = _make_pong(_ID.unpack_from(view, offset)[1])
                offset += _ID.size
            elif kind == _PICKLED:
                message, offset = _decode_pickled(view, offset, end)
            else:
                raise MalformedFrame(f"unknown record kind {kind} at byte {offset}")
            append(message)
    except MalformedFrame:
        raise
    except (struct.error, UnicodeError, ValueError, IndexError, OverflowError, MemoryError) as exc:
        raise MalformedFrame(f"a record at byte {offset} does not parse: {exc}") from None
    if offset != end:
        raise MalformedFrame(f"the last record runs past the frame's end ({offset} > {end})")
    return batch


def _decode_strings(view: memoryview, offset: int, count: int, end: int) -> tuple[list[str], int]:
    lengths_struct = _lengths(count)
    lengths = lengths_struct.unpack_from(view, offset)
    offset += lengths_struct.size
    strings = []
    for n in lengths:
        stop = offset + n
        if stop > end:
            raise MalformedFrame(f"a string runs past the frame's end ({stop} > {end})")
        strings.append(str(view[offset:stop], "utf-8", _ERRORS) if n else "")
        offset = stop
    return strings, offset


def _payload(view: memoryview, offset: int, position: int, nbytes: int, end: int):
    if position == _INLINE:
        stop = offset + nbytes
        if stop > end:
            raise MalformedFrame(f"a payload runs past the frame's end ({stop} > {end})")
        return bytes(view[offset:stop]), stop
    if position < 0:
        raise MalformedFrame(f"a slot at a negative position ({position})")
    return _make_slot(position, nbytes), offset


def _decode_request(view: memoryview, offset: int, end: int) -> tuple[Request, int]:
    _, kind, rid, deadline_ns, position, nbytes, count = _REQUEST_HEAD.unpack_from(view, offset)
    offset += _REQUEST_HEAD.size
    strings: Any = ()
    if count:
        strings, offset = _decode_strings(view, offset, count, end)
    call: Any
    if kind == _INFER or kind == _STREAM:
        if count:
            raise MalformedFrame(f"an untraced call with {count} strings")
        call = _UNTRACED[kind]
    elif kind == _INFER_TRACED or kind == _STREAM_TRACED:
        (context,) = strings
        call = InferCall(context) if kind == _INFER_TRACED else StreamCall(context)
    elif kind == _UNARY:
        (rpc,) = strings
        call = _unary_calls.get(rpc)
        if call is None:
            call = _unary_calls[rpc] = UnaryCall(rpc)
    elif kind == _REST:
        if count < 3 or count % 2 == 0:
            raise MalformedFrame(f"a REST call with {count} strings")
        method, path, query = strings[0], strings[1], strings[2]
        headers = dict(zip(strings[3::2], strings[4::2], strict=True))
        call = RestCall(method, path, query, headers)
    else:
        raise MalformedFrame(f"unknown call kind {kind}")
    payload, offset = _payload(view, offset, position, nbytes, end)
    return _make_request(rid, call, deadline_ns, payload), offset


def _decode_done(view: memoryview, offset: int, end: int) -> tuple[Done, int]:
    _, kind, rid, status, rest_status, position, nbytes, count = _DONE_HEAD.unpack_from(
        view, offset
    )
    offset += _DONE_HEAD.size
    detail: Detail
    if kind == _NO_DETAIL:
        if count > 1:
            raise MalformedFrame(f"an answer with {count} strings")
        text = ""
        if count:
            (text,), offset = _decode_strings(view, offset, count, end)
        detail = None
    elif kind == _ORIGIN:
        (text, model, request_id), offset = _decode_strings(view, offset, count, end)
        detail = StreamOrigin(model, request_id)
    elif kind == _REST_HEAD:
        if count < 2 or count % 2:
            raise MalformedFrame(f"a REST answer with {count} strings")
        strings, offset = _decode_strings(view, offset, count, end)
        text, content_type = strings[0], strings[1]
        headers = tuple(zip(strings[2::2], strings[3::2], strict=True))
        detail = RestHead(rest_status, content_type, headers)
    else:
        raise MalformedFrame(f"unknown answer detail kind {kind}")
    payload: Payload
    payload, offset = _payload(view, offset, position, nbytes, end)
    return _make_done(rid, status, text, payload, detail), offset


def _decode_pickled(view: memoryview, offset: int, end: int) -> tuple[Message, int]:
    nbytes = _COUNT.unpack_from(view, offset)[1]
    offset += _COUNT.size
    stop = offset + nbytes
    if stop > end:
        raise MalformedFrame(f"a pickled message runs past the frame's end ({stop} > {end})")
    try:
        message = pickle.loads(view[offset:stop])
    except Exception as exc:  # anything pickle raises on bytes it cannot load
        raise MalformedFrame(f"a pickled message does not load: {exc!r}") from None
    if message.__class__ not in _PICKLED_CLASSES:
        raise MalformedFrame(f"a pickled record is not a message: {type(message).__name__}")
    return message, stop


__all__ = ["MalformedFrame", "decode", "encode"]
