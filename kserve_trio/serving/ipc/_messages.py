"""The messages of the device/front-end channel: frozen dataclasses, matched by class.

Front end to device process:

- ``Ready``: the front end listens on these ports (sent once);
- ``Request``: serve this ``call`` (``UnaryCall``, ``InferCall``, ``StreamCall`` or
  ``RestCall``) on ``payload`` before ``deadline_ns``, the call's absolute
  ``time.monotonic_ns()`` deadline (0: none; CLOCK_MONOTONIC is one clock for every process of
  the machine);
- ``Cancel``: the client gave up on a request (its answer is still sent, and discarded);
- ``Free``: reply slots the front end has copied out;
- ``Edge``: the front end's edge counters changed (their Prometheus text);
- ``Pong``: the answer to a ``Ping``, sent by the front end's event loop.

Device process to front end:

- ``Hello``: the first message: the worker's resolved configuration, the front end's index,
  the RPCs it forwards (``ForwardedRpc``) and the message a call gets while the worker shuts
  down;
- ``Done``: a request's answer: a gRPC status (0: OK), its message, the reply, and what the
  call needs besides the reply (``StreamOrigin`` for a stream message, ``RestHead`` for a REST
  request; None otherwise);
- ``Log``: the log settings now in force (a LogSettings RPC changed them);
- ``Drain``: the worker is shutting down: stop accepting, drain, exit;
- ``Ping``: the liveness probe (``serving.liveness``): answer ``Pong`` at once.

A ``Payload`` is bytes carried in the frame itself, or a ``Slot`` of the sender's arena.

Each class pickles as itself and its fields' values (``_pickled_by_fields``): the default
pickling of a slotted dataclass goes through ``copyreg`` and a ``__setstate__`` per object and
costs several times the message's own fields. The classes a request and its answer are made of
also have a pickle extension code (``_EXTENSION_CODES``, from the range pickle leaves to
applications), so a frame names each in two bytes and the reader finds it without an import
lookup. Together they keep a message within a few microseconds of a plain tuple's.
"""

from __future__ import annotations

import copyreg
from dataclasses import dataclass, fields
from enum import StrEnum
from operator import attrgetter
from typing import TYPE_CHECKING, ClassVar, TypeVar

if TYPE_CHECKING:
    from kserve_trio.core.logging import LogSettings
    from kserve_trio.core.process import ServerConfig

_T = TypeVar("_T")


def _pickled_by_fields(cls: type[_T]) -> type[_T]:
    """``cls`` pickles as ``cls(*its field values)`` (module docstring)."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    if len(names) == 1:
        one = attrgetter(names[0])

        def reduce_one(self):
            return (cls, (one(self),))

        cls.__reduce__ = reduce_one  # type: ignore[method-assign]
    elif names:
        many = attrgetter(*names)

        def reduce_many(self):
            return (cls, many(self))

        cls.__reduce__ = reduce_many  # type: ignore[method-assign]
    else:

        def reduce_none(self):
            return (cls, ())

        cls.__reduce__ = reduce_none  # type: ignore[method-assign]
    return cls


# ---------------------------------------------------------------- what a request carries


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Slot:
    """``nbytes`` at ``position`` of the sender's arena (``Ring`` positions are absolute: the
    offset is ``position % size``)."""

    position: int
    nbytes: int


Payload = bytes | Slot
"""A request's message or a reply: in the frame, or in a slot of the sender's arena."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class UnaryCall:
    """A unary RPC answered by the device process's RPC layer: request bytes in, reply bytes
    out."""

    rpc: str


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class InferCall:
    """A ModelInfer request: its message in the request arena, its reply in the reply arena.
    ``trace_context``: the caller's W3C trace context (``trace_settings.caller_context``; None:
    none, or the worker does not trace), so the device process's span continues its trace."""

    trace_context: str | None = None
    rpc: ClassVar[str] = "ModelInfer"


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class StreamCall:
    """One message of a ModelStreamInfer call, answered with the stream's answer message
    (``trace_context``: the stream's, as for ``InferCall``)."""

    trace_context: str | None = None
    rpc: ClassVar[str] = "ModelStreamInfer"


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class RestCall:
    """One REST request (its body is the payload), answered with the HTTP reply's body and its
    ``RestHead``."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    rpc: ClassVar[str] = "REST"


Call = UnaryCall | InferCall | StreamCall | RestCall
"""What a ``Request`` asks the device process to serve; each class has its ``rpc`` name."""


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class StreamOrigin:
    """A stream message's model and request id: the front end names them in the error answer
    it writes itself when the device's answer is over its send cap."""

    model: str
    request_id: str


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class RestHead:
    """A REST reply's status line and headers (its body is the ``Done``'s payload)."""

    status: int
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()


Detail = StreamOrigin | RestHead | None
"""What a ``Done`` carries besides the reply, by the call's class."""


class RpcShape(StrEnum):
    """How a front end serves one RPC the device process lists."""

    UNARY = "unary"
    INFER = "infer"
    STREAM = "stream"
    UNIMPLEMENTED = "unimplemented"


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class ForwardedRpc:
    """One RPC of the worker as ``Hello`` lists it: its gRPC path and name, its shape, and for
    ``UNIMPLEMENTED`` the reason it is not served."""

    path: str
    rpc: str
    shape: RpcShape
    reason: str = ""


# ---------------------------------------------------------------- front end to device


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Ready:
    grpc_port: int
    http_port: int


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Request:
    id: int
    call: Call
    deadline_ns: int
    payload: Payload


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Cancel:
    id: int


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Free:
    slots: tuple[int, ...]


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Edge:
    exposition: str


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Pong:
    seq: int


# ---------------------------------------------------------------- device to front end


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Hello:
    config: ServerConfig
    index: int
    rpcs: tuple[ForwardedRpc, ...]
    shutting_down: str


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Done:
    id: int
    status: int
    message: str
    payload: Payload
    detail: Detail = None


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Log:
    settings: LogSettings


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Drain:
    pass


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Ping:
    seq: int


_EXTENSION_CODES: dict[type, int] = {
    cls: code
    for code, cls in enumerate(
        (
            Request,
            Done,
            Slot,
            UnaryCall,
            InferCall,
            StreamCall,
            RestCall,
            StreamOrigin,
            RestHead,
            Cancel,
            Free,
            Ping,
            Pong,
        ),
        start=240,  # 240-255: pickle's codes for private use
    )
}
for _cls, _code in _EXTENSION_CODES.items():
    copyreg.add_extension(_cls.__module__, _cls.__qualname__, _code)

ToDevice = Ready | Request | Cancel | Free | Edge | Pong
"""What a front end sends."""
ToFrontend = Hello | Done | Log | Drain | Ping
"""What the device process sends."""
Message = ToDevice | ToFrontend

__all__ = [
    "Call",
    "Cancel",
    "Detail",
    "Done",
    "Drain",
    "Edge",
    "ForwardedRpc",
    "Free",
    "Hello",
    "InferCall",
    "Log",
    "Message",
    "Payload",
    "Ping",
    "Pong",
    "Ready",
    "Request",
    "RestCall",
    "RestHead",
    "RpcShape",
    "Slot",
    "StreamCall",
    "StreamOrigin",
    "ToDevice",
    "ToFrontend",
    "UnaryCall",
]
