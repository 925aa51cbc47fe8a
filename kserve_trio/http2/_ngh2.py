"""The ``ngh2`` engine: libnghttp2 (through the ngh2 binding) behind our ``Engine`` seam.

libnghttp2 already keeps every rule of the seam: DATA is queued per stream and framed as flow
control admits it (``queued_body_size`` is *queued sends*' ``pending``), trailers follow the
queued body, received DATA is consumed explicitly (automatic WINDOW_UPDATEs are off, padding is
consumed by the library itself), and the defences of ``EngineSettings`` are its own options.
This module only translates: its events into ours, its exceptions into ``PeerError`` and
``StreamGone``.

A connection error of the peer's shows only once its GOAWAY is serialized (libnghttp2 then
reports ``ConnectionClosed`` with the code), so ``receive`` serializes what is queued before it
reads the events, and keeps the bytes for the next ``data_to_send``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import ngh2

from kserve_trio.http2._engine import EngineSettings as Settings
from kserve_trio.http2._engine import ErrorCode, PeerError, StreamGone
from kserve_trio.http2._events import (
    DataReceived,
    Event,
    GoAwayReceived,
    Header,
    PingAcknowledged,
    PingReceived,
    RequestReceived,
    ResponseReceived,
    SettingsReceived,
    StreamReset,
    TrailersReceived,
    WindowOpened,
)

_DATA = ngh2.DataReceived
_REQUEST = ngh2.RequestReceived
_RESPONSE = ngh2.ResponseReceived
_TRAILERS = ngh2.TrailersReceived
_WINDOW = ngh2.WindowUpdated
_CLOSED = ngh2.StreamClosed
_RESET = ngh2.StreamReset
_SETTINGS = ngh2.SettingsReceived
_PING = ngh2.PingReceived
_PING_ACK = ngh2.PingAcknowledged
_GOAWAY = ngh2.GoAwayReceived
_CONNECTION_CLOSED = ngh2.ConnectionClosed


class Ngh2Engine:
    """One HTTP/2 connection on libnghttp2 (module docstring)."""

    name = "ngh2"

    __slots__ = (
        "_conn",
        "_held",
        "_last_stream_id",
        "_reset_by_peer",
        "_resets_after",
        "_settings",
    )

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        config = ngh2.Configuration(
            auto_window_update=False,
            max_outbound_ack=settings.max_outbound_acks,
            max_settings=settings.max_settings_entries,
            stream_reset_rate_limit=settings.reset_rate,
            max_continuations=settings.max_continuations,
            glitch_rate_limit=settings.glitch_rate,
            max_inbound_header_list_size=settings.max_header_list,
            max_inbound_header_count=settings.max_header_fields,
        )
        role = ngh2.Role.CLIENT if settings.client else ngh2.Role.SERVER
        self._conn = ngh2.Connection(role, config)
        self._held = b""  # bytes serialized early to read a connection error's code
        self._reset_by_peer: set[int] = set()
        self._resets_after: list[int] = []  # NO_ERROR resets that follow a response
        self._last_stream_id = 0  # the highest stream the peer opened

    def initiate(self) -> None:
        s = self._settings
        advertised: dict[int, int] = {
            ngh2.Setting.INITIAL_WINDOW_SIZE: s.stream_window,
            ngh2.Setting.MAX_FRAME_SIZE: s.max_frame,
            ngh2.Setting.MAX_HEADER_LIST_SIZE: s.max_header_list,
        }
        if s.client:
            advertised[ngh2.Setting.ENABLE_PUSH] = 0
        if s.max_concurrent_streams:
            advertised[ngh2.Setting.MAX_CONCURRENT_STREAMS] = s.max_concurrent_streams
        self._conn.initiate_connection(advertised)
        if s.connection_window > 65535:
            self._conn.set_local_window_size(s.connection_window)

    # ---------------------------------------------------------------- receiving

    def receive(self, data: bytes) -> list[Event]:
        conn = self._conn
        try:
            conn.receive_data(data)
            # Serialized now: a connection error shows as ``ConnectionClosed`` only once its
            # GOAWAY is (module docstring).
            self._held += conn.data_to_send()
            raw: list[Any] = conn.events()
        except ngh2.NGH2Error as exc:
            raise self._fatal(exc) from None
        out: list[Event] = []
        append = out.append
        for event in raw:
            kind = event.__class__
            if kind is _DATA:
                body = event.data
                append(DataReceived(event.stream_id, body, len(body), event.end_stream))
            elif kind is _REQUEST:
                sid = event.stream_id
                if sid > self._last_stream_id:
                    self._last_stream_id = sid
                append(RequestReceived(sid, event.headers, event.end_stream))
            elif kind is _WINDOW:
                append(WindowOpened(event.stream_id))
            elif kind is _CLOSED:
                sid = event.stream_id
                if sid in self._reset_by_peer:
                    self._reset_by_peer.discard(sid)
                elif event.error_code:  # a stream error the library answered itself
                    append(StreamReset(sid, event.error_code, remote=False))
            elif kind is _TRAILERS:
                append(TrailersReceived(event.stream_id, event.headers))
            elif kind is _RESPONSE:
                append(ResponseReceived(event.stream_id, event.headers, event.end_stream))
            elif kind is _RESET:
                self._reset_by_peer.add(event.stream_id)
                append(StreamReset(event.stream_id, event.error_code))
            elif kind is _SETTINGS:
                append(SettingsReceived())
            elif kind is _PING:
                append(PingReceived(event.opaque_data))
            elif kind is _PING_ACK:
                append(PingAcknowledged(event.opaque_data))
            elif kind is _GOAWAY:
                append(GoAwayReceived(event.last_stream_id, event.error_code, event.debug_data))
            elif kind is _CONNECTION_CLOSED and event.error_code:  # *peer errors*
                raise PeerError(
                    event.error_code,
                    event.debug_data.decode("latin-1") or ErrorCode(event.error_code).name,
                    event.debug_data,
                )
        return out

    # ---------------------------------------------------------------- sending

    def data_to_send(self) -> bytes:
        try:
            data = self._conn.data_to_send()
            if self._resets_after:
                data += self._reset_after_responses()
        except ngh2.NGH2Error:  # the session has ended
            data = b""
        if self._held:
            data, self._held = self._held + data, b""
        return data

    def _fatal(self, exc: ngh2.NGH2Error) -> PeerError:
        """A receive the library refused outright (a flood, too many CONTINUATION frames, not
        HTTP/2 at all): it leaves the session unusable and sends nothing, so the GOAWAY that
        tells the peer why is written here (*peer errors*)."""
        flood = isinstance(exc, ngh2.DenialOfServiceError)
        code = ErrorCode.ENHANCE_YOUR_CALM if flood else ErrorCode.PROTOCOL_ERROR
        reason = str(exc).removeprefix("HTTP/2 engine error: ")
        debug = reason.encode("ascii", "replace")[:200]
        self._held += _goaway_frame(self._last_stream_id, code, debug)
        return PeerError(code, reason, debug)

    def _reset_after_responses(self) -> bytes:
        """The NO_ERROR resets whose streams have nothing left to send (``reset_stream``)."""
        conn = self._conn
        waiting = []
        for sid in self._resets_after:
            if self.pending(sid):
                waiting.append(sid)
            else:
                try:
                    conn.reset_stream(sid, ErrorCode.NO_ERROR)
                except (ngh2.NGH2Error, ValueError):
                    pass
        self._resets_after = waiting
        return conn.data_to_send()

    def send_request(self, headers: Iterable[Header], end_stream: bool = False) -> int:
        try:
            return self._conn.send_request(headers, end_stream=end_stream)
        except ngh2.NGH2Error as exc:
            raise StreamGone(str(exc)) from None

    def send_headers(
        self, stream_id: int, headers: Iterable[Header], end_stream: bool = False
    ) -> None:
        try:
            self._conn.send_response(stream_id, headers, end_stream=end_stream)
        except ngh2.NGH2Error as exc:
            raise StreamGone(str(exc)) from None

    def send_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        try:
            self._conn.send_data(stream_id, data, end_stream=end_stream)
        except ngh2.NGH2Error as exc:
            raise StreamGone(str(exc)) from None

    def send_trailers(self, stream_id: int, headers: Iterable[Header]) -> None:
        try:
            self._conn.send_trailers(stream_id, headers)
        except ngh2.NGH2Error as exc:
            raise StreamGone(str(exc)) from None

    def end_stream(self, stream_id: int) -> None:
        try:
            self._conn.end_stream(stream_id)
        except ngh2.NGH2Error as exc:
            raise StreamGone(str(exc)) from None

    def reset_stream(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        if code == ErrorCode.NO_ERROR:
            # After a whole response (RFC 9113 8.1: "stop sending the request"): libnghttp2
            # sends RST_STREAM ahead of queued HEADERS and DATA and drops them, so it waits
            # until the response has been serialized (*trailers last*).
            self._resets_after.append(stream_id)
            return
        try:
            self._conn.reset_stream(stream_id, code)
        except (ngh2.NGH2Error, ValueError):
            pass

    def acknowledge(self, stream_id: int, n: int) -> None:
        try:
            self._conn.acknowledge_received_data(n, stream_id)
        except (ngh2.NGH2Error, ValueError):  # the stream is gone: its bytes went with it
            pass

    def pending(self, stream_id: int) -> int:
        try:
            return self._conn.queued_body_size(stream_id)
        except (ngh2.NGH2Error, ValueError):
            return 0

    def send_window(self, stream_id: int) -> int:
        conn = self._conn
        try:
            return min(conn.stream_remote_window_size(stream_id), conn.remote_window_size)
        except (ngh2.NGH2Error, ValueError):
            return 0

    def ping(self, data: bytes) -> None:
        try:
            self._conn.ping(data)
        except ngh2.NGH2Error:  # the connection is ending: no answer is needed
            pass

    @property
    def peer_max_streams(self) -> int:
        return self._conn.remote_settings.get(ngh2.Setting.MAX_CONCURRENT_STREAMS, _UNBOUNDED)

    def goaway_notice(self) -> None:
        try:
            self._conn.send_shutdown_notice()
            # Serialized now: libnghttp2 would send a PING queued next ahead of it, and the
            # drain's PING proves the client has seen the GOAWAY only when it follows it.
            self._held += self._conn.data_to_send()
        except ngh2.NGH2Error:
            pass

    def goaway(self, code: int = ErrorCode.NO_ERROR, debug: bytes = b"") -> None:
        try:
            self._conn.send_goaway(code, debug_data=debug)
        except ngh2.NGH2Error:
            pass


def _goaway_frame(last_stream_id: int, code: int, debug: bytes) -> bytes:
    """One GOAWAY frame (RFC 9113 6.8), for a session the library gave up on."""
    payload = _GOAWAY_PAYLOAD.pack(last_stream_id & 0x7FFFFFFF, code) + debug
    return _FRAME_HEAD.pack(len(payload) >> 8, len(payload) & 0xFF, 0x7, 0, 0) + payload


_UNBOUNDED = 2**31 - 1
_FRAME_HEAD = struct.Struct(">HBBBL")
_GOAWAY_PAYLOAD = struct.Struct(">LL")

__all__ = ["Ngh2Engine"]
