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
costs several times the message's own fields. Only the rare messages (``Hello``, ``Log``,
``Edge``, ``Ready``, ``Drain``) cross the channel pickled as themselves; those of a request and
its answer cross as plain tuples of their fields (``_framing``).

The per-request classes are also built without the frozen ``__init__`` (``_built_fast``): a
frozen dataclass sets each field through ``object.__setattr__``, which costs more than the rest
of the message's trip; those classes instead build a plain slotted twin of the same layout and
give it its class (one ``__class__`` assignment, allowed because the two layouts are the same),
about twice as fast. The instance is the frozen dataclass all the same: equal, hashable,
immutable, matched by class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

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


_MAKERS: dict[type, Callable[..., Any]] = {}
_TWINS: dict[type, type] = {}


def _built_fast(cls: type[_T]) -> type[_T]:
    """``cls(...)`` builds a slotted twin of ``cls``'s layout and gives it ``cls`` as its class,
    instead of the frozen ``__init__``'s ``object.__setattr__`` per field (module docstring);
    ``maker(cls)`` is the same construction without the class call, for the frame's reader."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    assert tuple(names) == cls.__slots__, cls  # type: ignore[attr-defined]
    slots = cls.__slots__  # type: ignore[attr-defined]
    twin = type(f"_{cls.__name__}Fields", (), {"__slots__": slots})
    namespace: dict[str, Any] = {"_new": object.__new__, "_twin": twin, "_cls": cls}
    params = []
    for f in fields(cls):  # type: ignore[arg-type]
        assert f.default_factory is MISSING, (cls, f.name)
        if f.default is MISSING:
            params.append(f.name)
        else:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"    self.{n} = {n}\n" for n in names)
    source = (
        f"def make({', '.join(params)}):\n    self = _new(_twin)\n{body}"
        "    self.__class__ = _cls\n    return self\n"
        f"def __new__(cls, {', '.join(params)}):\n    self = _new(_twin)\n{body}"
        "    self.__class__ = cls\n    return self\n"
    )
    exec(source, namespace)  # generated from the dataclass's own field names
    cls.__new__ = staticmethod(namespace["__new__"])  # type: ignore[method-assign,assignment]
    cls.__init__ = object.__init__  # type: ignore[method-assign,assignment]
    _MAKERS[cls] = namespace["make"]
    _TWINS[cls] = twin
    return cls


def maker(cls: type[_T]) -> Callable[..., _T]:
    """``cls``'s constructor without the class call (``_built_fast``): positional fields in,
    the frozen instance out."""
    return _MAKERS[cls]


def layout_twin(cls: type) -> type:
    """The plain slotted class of ``cls``'s layout (``_built_fast``): the frame's reader builds
    its hottest messages inline, ``object.__new__`` of it, its fields set, then
    ``__class__ = cls``, saving a call per message."""
    return _TWINS[cls]


# ---------------------------------------------------------------- what a request carries


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Slot:
    """``nbytes`` at ``position`` of the sender's arena (``Ring`` positions are absolute: the
    offset is ``position % size``)."""

    position: int
    nbytes: int


Payload = bytes | Slot
"""A request's message or a reply: in the frame, or in a slot of the sender's arena."""


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class UnaryCall:
    """A unary RPC answered by the device process's RPC layer: request bytes in, reply bytes
    out."""

    rpc: str


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class InferCall:
    """A ModelInfer request: its message in the request arena, its reply in the reply arena.
    ``trace_context``: the caller's W3C trace context (``trace_settings.caller_context``; None:
    none, or the worker does not trace), so the device process's span continues its trace."""

    trace_context: str | None = None
    rpc: ClassVar[str] = "ModelInfer"


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class StreamCall:
    """One message of a ModelStreamInfer call, answered with the stream's answer message
    (``trace_context``: the stream's, as for ``InferCall``)."""

    trace_context: str | None = None
    rpc: ClassVar[str] = "ModelStreamInfer"


@_built_fast
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


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class StreamOrigin:
    """A stream message's model and request id: the front end names them in the error answer
    it writes itself when the device's answer is over its send cap."""

    model: str
    request_id: str


@_built_fast
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


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Request:
    id: int
    call: Call
    deadline_ns: int
    payload: Payload


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Cancel:
    id: int


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Free:
    slots: tuple[int, ...]


@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Edge:
    exposition: str


@_built_fast
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


@_built_fast
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


@_built_fast
@_pickled_by_fields
@dataclass(frozen=True, slots=True)
class Ping:
    seq: int


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
