"""What a conformance case expects, and how the answer is judged on a ``RawClient``.

Every case's bytes are followed by one PING carrying ``SENTINEL``: the server handles frames
in order, so its acknowledgement says every frame of the case was taken and judged. That is how
a case knows, without waiting on a clock, that the server went on where it should have ended
the connection (or reset no stream where it should have).

- ``connection_error(*codes)``: a GOAWAY with one of ``codes``, then the close. A close without
  any GOAWAY is accepted too (RFC 9113 says an endpoint SHOULD send one, as h2spec reads it).
- ``stream_error(*codes, stream=)``: RST_STREAM with one of ``codes`` on that stream before the
  sentinel's ACK, and the connection goes on (the sentinel PING is answered, no GOAWAY).
- ``either_error(*codes, stream=)``: where the RFC leaves the choice, one of the two above.
- ``error_or_ignored(*codes)``: where the RFC allows ignoring the frame, a connection or stream
  error with one of ``codes``, or nothing: then the connection serves a call as ``served``.
- ``grpc(status, http=, stream=)``: a response on the stream with that ``:status`` and
  ``grpc-status`` (trailers or trailers-only).
- ``ping_ack(opaque, unanswered=)``: a PING ACK carrying ``opaque`` and none carrying any of
  ``unanswered``.
- ``served(settings_acks=)``: the connection goes on (no GOAWAY, at least ``settings_acks``
  SETTINGS ACKs) and a ModelInfer call on the echo model is answered on it.

``call_echo`` is that call; ``serves`` makes it on a new connection (the probe after every case).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kserve_trio.core.errors import StatusCode
from kserve_trio.proto import inference as pb
from tests.serving.grpc.conformance.frames import ECHO_INPUT, Wire
from tests.serving.grpc.conformance.raw_client import RawClient, code_name
from tests.serving.grpc.h2_peer import grpc_messages

SENTINEL = b"sentinel"
"""The opaque data of the PING sent after every case's bytes."""


class Outcome(Protocol):
    def judge(self, client: RawClient, wire: Wire) -> None:
        """Read the server's answer and assert it is the expected one."""
        ...


def _fail(expected: object, client: RawClient, detail: str) -> AssertionError:
    return AssertionError(f"expected {expected}: {detail}; the server sent: {client.answer()}")


def _names(codes: Sequence[int]) -> str:
    return " or ".join(code_name(c) for c in codes)


def _sentinel_acked(client: RawClient) -> bool:
    return SENTINEL in client.ping_acks


def _ends_connection(expected: object, client: RawClient, codes: Sequence[int]) -> None:
    """The GOAWAY (when one came) has one of ``codes`` and the close follows it."""
    goaway = client.goaway
    if goaway is not None:
        if goaway.code not in codes:
            raise _fail(expected, client, f"GOAWAY {code_name(goaway.code)}")
        client.wait_for(lambda: False, "the close after the GOAWAY")


@dataclass(frozen=True)
class ConnectionError_:
    codes: tuple[int, ...]

    def __str__(self) -> str:
        return f"connection error {_names(self.codes)}"

    def judge(self, client: RawClient, wire: Wire) -> None:
        client.wait_for(
            lambda: client.goaway is not None or _sentinel_acked(client), "a GOAWAY or the close"
        )
        if client.goaway is None and not client.closed:
            raise _fail(self, client, "the connection went on (the sentinel PING was answered)")
        _ends_connection(self, client, self.codes)


@dataclass(frozen=True)
class StreamError:
    codes: tuple[int, ...]
    stream: int
    either: bool = False  # a connection error with one of the codes is accepted too

    def __str__(self) -> str:
        kind = "stream or connection error" if self.either else "stream error"
        return f"{kind} {_names(self.codes)} on stream {self.stream}"

    def judge(self, client: RawClient, wire: Wire) -> None:
        sid = self.stream
        client.wait_for(
            lambda: sid in client.resets or client.goaway is not None or _sentinel_acked(client),
            f"RST_STREAM on stream {sid}",
        )
        if sid in client.resets:
            if client.resets[sid] not in self.codes:
                raise _fail(self, client, f"RST_STREAM {code_name(client.resets[sid])}")
            client.wait_for(
                lambda: client.goaway is not None or _sentinel_acked(client), "the sentinel PING"
            )
            if client.goaway is not None or client.closed:
                raise _fail(self, client, "the connection ended after the stream error")
            return
        ended = client.goaway is not None or client.closed
        if not ended:
            client.settle(sid)
            raise _fail(self, client, "no reset before the sentinel PING's ACK")
        if not self.either:
            raise _fail(self, client, "a connection error")
        _ends_connection(self, client, self.codes)


@dataclass(frozen=True)
class Grpc:
    status: StatusCode
    http: int
    stream: int

    def __str__(self) -> str:
        return f"a response :status {self.http} grpc-status {self.status.name} on {self.stream}"

    def judge(self, client: RawClient, wire: Wire) -> None:
        sid = self.stream
        client.wait_for(
            lambda: client.done(sid) or client.goaway is not None, f"the answer on stream {sid}"
        )
        http, status = client.http_status(sid), client.grpc_status(sid)
        if sid not in client.ended or http != str(self.http) or status != int(self.status):
            raise _fail(self, client, f":status {http} grpc-status {status}")


@dataclass(frozen=True)
class PingAck:
    opaque: bytes
    unanswered: tuple[bytes, ...]

    def __str__(self) -> str:
        return f"PING ACK {self.opaque!r}"

    def judge(self, client: RawClient, wire: Wire) -> None:
        client.wait_for(
            lambda: self.opaque in client.ping_acks or client.goaway is not None, str(self)
        )
        stray = [o for o in self.unanswered if o in client.ping_acks]
        if self.opaque not in client.ping_acks or client.goaway is not None or stray:
            raise _fail(self, client, f"acknowledged {client.ping_acks}")


@dataclass(frozen=True)
class Served:
    settings_acks: int

    def __str__(self) -> str:
        return "the connection to go on and serve a call"

    def judge(self, client: RawClient, wire: Wire) -> None:
        client.wait_for(
            lambda: client.goaway is not None or _sentinel_acked(client), "the sentinel PING"
        )
        if client.goaway is not None or client.closed:
            raise _fail(self, client, "the connection ended")
        if client.settings_acks < self.settings_acks:
            raise _fail(self, client, f"{client.settings_acks} SETTINGS ACKs")
        call_echo(client, wire, wire.next_stream())


@dataclass(frozen=True)
class ErrorOrIgnored:
    codes: tuple[int, ...]

    def __str__(self) -> str:
        return f"{_names(self.codes)} (connection or stream error), or the frame ignored"

    def judge(self, client: RawClient, wire: Wire) -> None:
        client.wait_for(
            lambda: client.goaway is not None or _sentinel_acked(client), "the sentinel PING"
        )
        if client.goaway is not None or client.closed:
            _ends_connection(self, client, self.codes)
            return
        wrong = {sid: code for sid, code in client.resets.items() if code not in self.codes}
        if wrong:
            raise _fail(self, client, f"RST_STREAM {wrong}")
        call_echo(client, wire, wire.next_stream())


def call_echo(client: RawClient, wire: Wire, stream: int) -> None:
    """A ModelInfer call on the echo model on ``stream``: answered OK with its input."""
    client.send(wire.echo_call(stream))
    Grpc(StatusCode.OK, 200, stream).judge(client, wire)
    (message,) = grpc_messages(client.body.get(stream, b""))
    reply = pb.ModelInferResponse.FromString(message)
    assert reply.raw_output_contents[0] == ECHO_INPUT.tobytes(), reply


def serves(port: int) -> None:
    """A new connection to ``port`` is served an echo call (the probe after every case)."""
    with RawClient.connect(port) as client:
        client.handshake()
        call_echo(client, Wire(client.server_settings), 1)


def connection_error(*codes: int) -> Outcome:
    return ConnectionError_(codes)


def stream_error(*codes: int, stream: int = 1) -> Outcome:
    return StreamError(codes, stream)


def either_error(*codes: int, stream: int = 1) -> Outcome:
    return StreamError(codes, stream, either=True)


def grpc(status: StatusCode, http: int = 200, stream: int = 1) -> Outcome:
    return Grpc(status, http, stream)


def error_or_ignored(*codes: int) -> Outcome:
    return ErrorOrIgnored(codes)


def ping_ack(opaque: bytes, unanswered: tuple[bytes, ...] = ()) -> Outcome:
    return PingAck(opaque, unanswered)


def served(settings_acks: int = 1) -> Outcome:
    return Served(settings_acks)


__all__ = [
    "SENTINEL",
    "Outcome",
    "call_echo",
    "connection_error",
    "either_error",
    "error_or_ignored",
    "grpc",
    "ping_ack",
    "served",
    "serves",
    "stream_error",
]
