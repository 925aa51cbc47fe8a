"""The ``h2`` engine: the pure-Python h2 library behind our ``Engine`` seam, the fallback when
the native engine cannot be used.

h2 leaves three of the seam's rules to its user, and this module keeps them:

- *Queued sends*: h2 refuses DATA beyond the peer's window, so each stream that has to wait
  gets a queue here (its chunks as views of the caller's buffers, its trailers, its END_STREAM)
  that moves as WINDOW_UPDATEs and SETTINGS arrive, in frames of at most the peer's frame size.
- *Peer errors*, with the RFC's codes where h2's differ: an HPACK error is COMPRESSION_ERROR
  (h2 says PROTOCOL_ERROR), a SETTINGS acknowledgement with a payload FRAME_SIZE_ERROR; and
  the defences libnghttp2 has natively run first, on the frame headers (``_h2_guard``).
- One stream too many is refused alone (RST_STREAM REFUSED_STREAM) rather than ending the
  connection: h2's own check is turned off (``_AdvertisedSettings``) and the limit is applied
  here on the streams h2 has open.

The *two-phase GOAWAY* is written as frames h2 does not know about: h2 closes its state machine
on its own GOAWAY, which would end the calls still running; the streams a client opens after
our final GOAWAY are refused here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hpack.exceptions import HPACKError, OversizedHeaderListError
from hyperframe.frame import GoAwayFrame

from kserve_trio.http2._engine import (
    MAX_STREAM_ID,
    EngineSettings,
    ErrorCode,
    PeerError,
    StreamGone,
)
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
from kserve_trio.http2._h2_guard import FrameGuard
from kserve_trio.http2._h2_repr import patch_frame_repr

patch_frame_repr()

_UNBOUNDED_STREAMS = 2**32 + 1
"""h2's own value for "no SETTINGS_MAX_CONCURRENT_STREAMS"."""
_GOAWAY_BYTES = 17
"""h2's GOAWAY without debug data: 9 bytes of frame header and 8 of payload."""


class _AdvertisedSettings(h2.settings.Settings):
    """Our SETTINGS as sent, with h2's check of the stream limit turned off: h2 ends the
    connection for one stream too many (and before the client has acknowledged our SETTINGS it
    checks its own default of 100), where RFC 9113 lets the server refuse just that stream. The
    value stays in the mapping, so the SETTINGS frame carries it; only the property h2 reads
    for its check says unbounded."""

    @property
    def max_concurrent_streams(self) -> int:
        return _UNBOUNDED_STREAMS

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = value


class _Connection(h2.connection.H2Connection):
    """h2's connection, except for a graceful GOAWAY from the peer: h2 closes its whole state
    machine on any GOAWAY (and drops what it had queued to send), where a graceful one only
    means no new streams, the streams in flight going on (RFC 9113 6.8)."""

    def _receive_goaway_frame(self, frame: Any) -> tuple[list[Any], list[Any]]:
        if frame.error_code:
            return super()._receive_goaway_frame(frame)
        event = h2.events.ConnectionTerminated()
        event.error_code = h2.errors.ErrorCodes.NO_ERROR
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]


class _Queue:
    """One stream's DATA waiting for window, and what follows it."""

    __slots__ = ("chunks", "end", "reset_after", "size", "trailers")

    def __init__(self) -> None:
        self.chunks: deque[memoryview] = deque()
        self.size = 0
        self.end = False
        self.trailers: list[Header] | None = None
        self.reset_after = False


def _view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class H2Engine:
    """One HTTP/2 connection on h2 (module docstring)."""

    name = "h2"

    __slots__ = (
        "_conn",
        "_guard",
        "_last_stream_id",
        "_max_streams",
        "_moved",
        "_open_before",
        "_queues",
        "_settings",
    )

    def __init__(self, settings: EngineSettings) -> None:
        self._settings = settings
        self._conn = _Connection(
            h2.config.H2Configuration(
                client_side=settings.client,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=True,
                normalize_inbound_headers=True,
            )
        )
        self._guard = FrameGuard(settings, preface=not settings.client)
        self._queues: dict[int, _Queue] = {}
        self._moved = False  # the peer's windows grew: queued DATA may go on
        self._max_streams = settings.max_concurrent_streams or _UNBOUNDED_STREAMS
        self._last_stream_id = MAX_STREAM_ID  # lowered by the final GOAWAY
        self._open_before = 0  # the peer's open streams, counted through one read's requests

    def initiate(self) -> None:
        s = self._settings
        codes = h2.settings.SettingCodes
        advertised = {
            codes.INITIAL_WINDOW_SIZE: s.stream_window,
            codes.MAX_FRAME_SIZE: s.max_frame,
            codes.MAX_HEADER_LIST_SIZE: s.max_header_list,
        }
        if s.client:
            advertised[codes.ENABLE_PUSH] = 0
        if s.max_concurrent_streams:
            advertised[codes.MAX_CONCURRENT_STREAMS] = s.max_concurrent_streams
        conn = self._conn
        # In force at once, not only once the peer acknowledges them: a peer may send a large
        # DATA frame ahead of that, and accepting more than advertised is always safe.
        if s.client:
            conn.local_settings = h2.settings.Settings(client=True, initial_values=advertised)
        else:
            conn.local_settings = _AdvertisedSettings(client=False, initial_values=advertised)
        conn.decoder.max_header_list_size = s.max_header_list
        conn.initiate_connection()
        conn.max_inbound_frame_size = s.max_frame
        if s.connection_window > 65535:
            conn.increment_flow_control_window(s.connection_window - 65535)

    # ---------------------------------------------------------------- receiving

    def receive(self, data: bytes) -> list[Event]:
        conn = self._conn
        broken = self._guard.scan(data)
        if broken is not None:  # refused before h2 buffers or answers any of it
            self._final_goaway(broken.code, broken.debug)
            raise PeerError(broken.code, broken.debug.decode(), broken.debug, broken.debug.decode())
        try:
            raw: list[Any] = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            code = self._rfc_code(exc)
            if code != exc.error_code:
                self._replace_goaway(code)
            raise PeerError(code, str(exc)[:200]) from None
        except Exception as exc:  # a parsing bug must end this connection, nothing more
            self._final_goaway(ErrorCode.PROTOCOL_ERROR)
            raise PeerError(ErrorCode.PROTOCOL_ERROR, repr(exc)[:200]) from None
        out: list[Event] = []
        append = out.append
        told: list[Any] = []  # StreamEnded events already told by the event they came with
        self._open_before = self._streams_open_before(raw)
        for event in raw:
            kind = event.__class__
            if kind is h2.events.DataReceived:
                if event.stream_ended is not None:
                    told.append(event.stream_ended)
                append(
                    DataReceived(
                        event.stream_id,
                        event.data,
                        event.flow_controlled_length,
                        event.stream_ended is not None,
                    )
                )
            elif kind is h2.events.RequestReceived:
                if event.stream_ended is not None:
                    told.append(event.stream_ended)
                self._request(event, append)
            elif kind is h2.events.StreamEnded:
                if not any(event is seen for seen in told):
                    append(DataReceived(event.stream_id, b"", 0, True))
            elif kind is h2.events.WindowUpdated:
                self._moved = True
                append(WindowOpened(event.stream_id or 0))
            elif kind is h2.events.TrailersReceived:
                told.append(event.stream_ended)
                append(TrailersReceived(event.stream_id, event.headers))
            elif kind is h2.events.ResponseReceived:
                if event.stream_ended is not None:
                    told.append(event.stream_ended)
                append(
                    ResponseReceived(
                        event.stream_id,
                        event.headers,
                        event.stream_ended is not None,
                    )
                )
            elif kind is h2.events.StreamReset:
                self._queues.pop(event.stream_id, None)
                append(StreamReset(event.stream_id, int(event.error_code or 0), event.remote_reset))
            elif kind is h2.events.RemoteSettingsChanged:
                self._moved = True
                append(SettingsReceived())
            elif kind is h2.events.PingReceived:
                append(PingReceived(event.ping_data))
            elif kind is h2.events.PingAckReceived:
                append(PingAcknowledged(event.ping_data))
            elif kind is h2.events.ConnectionTerminated:
                append(
                    GoAwayReceived(
                        event.last_stream_id or 0,
                        int(event.error_code or 0),
                        event.additional_data or b"",
                    )
                )
        return out

    def _streams_open_before(self, raw: list[Any]) -> int:
        """The peer's streams that were open before this read: h2 has already opened (and
        counted) every stream of the read by the time its events are looked at."""
        opened = {e.stream_id for e in raw if e.__class__ is h2.events.RequestReceived}
        if not opened:
            return 0
        gone = sum(1 for e in raw if e.__class__ is h2.events.StreamReset and e.stream_id in opened)
        return self._conn.open_inbound_streams - (len(opened) - gone)

    def _request(self, event: h2.events.RequestReceived, append: Any) -> None:
        """A new stream: refused alone past the stream limit or after our final GOAWAY."""
        sid = event.stream_id
        assert sid is not None
        if sid > self._last_stream_id or self._open_before >= self._max_streams:
            self.reset_stream(sid, ErrorCode.REFUSED_STREAM)
            append(StreamReset(sid, ErrorCode.REFUSED_STREAM, remote=False))
            return
        if not _path_ok(event.headers):  # RFC 9113 8.3.1: a malformed request
            self.reset_stream(sid, ErrorCode.PROTOCOL_ERROR)
            append(StreamReset(sid, ErrorCode.PROTOCOL_ERROR, remote=False))
            return
        self._open_before += 1
        append(RequestReceived(sid, event.headers, event.stream_ended is not None))

    @staticmethod
    def _rfc_code(exc: h2.exceptions.ProtocolError) -> int:
        """The RFC's error code for what h2 refused (module docstring)."""
        cause = exc.__cause__
        if isinstance(cause, HPACKError) and not isinstance(cause, OversizedHeaderListError):
            return ErrorCode.COMPRESSION_ERROR
        if isinstance(cause, (IndexError, TypeError, UnicodeDecodeError)):
            return ErrorCode.COMPRESSION_ERROR
        if cause is not None and "ack frame must not have payload" in str(cause):
            return ErrorCode.FRAME_SIZE_ERROR
        return int(exc.error_code)

    def _replace_goaway(self, code: int) -> None:
        """Put ``code`` in the GOAWAY h2 just queued for its own view of the error."""
        conn = self._conn
        queued = conn._data_to_send  # the frames h2 has serialized and not handed out
        if len(queued) >= _GOAWAY_BYTES and queued[-_GOAWAY_BYTES + 3] == 0x7:
            del queued[-_GOAWAY_BYTES:]
            queued += GoAwayFrame(
                0, last_stream_id=conn.highest_inbound_stream_id, error_code=code
            ).serialize()

    # ---------------------------------------------------------------- sending

    def data_to_send(self) -> bytes:
        if self._moved:
            self._moved = False
            if self._queues:
                for sid in list(self._queues):
                    self._flush(sid)
        return self._conn.data_to_send()

    def send_request(self, headers: Iterable[Header], end_stream: bool = False) -> int:
        conn = self._conn
        try:
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, list(headers), end_stream=end_stream)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as exc:
            raise StreamGone(str(exc)) from None
        return sid

    def send_headers(
        self, stream_id: int, headers: Iterable[Header], end_stream: bool = False
    ) -> None:
        try:
            self._conn.send_headers(stream_id, list(headers), end_stream=end_stream)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as exc:
            raise StreamGone(str(exc)) from None

    def send_data(self, stream_id: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        queue = self._queues.get(stream_id)
        if queue is None:
            conn = self._conn
            try:
                room = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
                if len(data) <= room:
                    conn.send_data(stream_id, data, end_stream=end_stream)
                    return
            except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as exc:
                raise StreamGone(str(exc)) from None
            queue = self._queues[stream_id] = _Queue()
        view = _view(data)
        if view.nbytes:
            queue.chunks.append(view)
            queue.size += view.nbytes
        queue.end = end_stream
        self._flush(stream_id)

    def send_trailers(self, stream_id: int, headers: Iterable[Header]) -> None:
        queue = self._queues.get(stream_id)
        if queue is not None:
            queue.trailers = list(headers)
            return
        self.send_headers(stream_id, headers, end_stream=True)

    def end_stream(self, stream_id: int) -> None:
        queue = self._queues.get(stream_id)
        if queue is not None:
            queue.end = True
            return
        try:
            self._conn.end_stream(stream_id)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as exc:
            raise StreamGone(str(exc)) from None

    def _flush(self, sid: int) -> None:
        """Move ``sid``'s queued DATA as far as its windows allow (*queued sends*)."""
        queue = self._queues[sid]
        conn = self._conn
        try:
            while queue.chunks:
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room <= 0:
                    return
                chunk = queue.chunks[0]
                if chunk.nbytes <= room:
                    queue.chunks.popleft()
                    piece = chunk
                else:
                    piece = chunk[:room]
                    queue.chunks[0] = chunk[room:]
                queue.size -= piece.nbytes
                conn.send_data(sid, piece, end_stream=queue.end and not queue.chunks)
            del self._queues[sid]
            if queue.trailers is not None:
                conn.send_headers(sid, queue.trailers, end_stream=True)
            if queue.reset_after:
                conn.reset_stream(sid, ErrorCode.NO_ERROR)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            self._queues.pop(sid, None)  # the stream is gone: its queue goes with it

    def reset_stream(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        queue = self._queues.get(stream_id)
        if queue is not None and code == ErrorCode.NO_ERROR:
            queue.reset_after = True  # after the whole response (*trailers last*)
            return
        self._queues.pop(stream_id, None)
        try:
            self._conn.reset_stream(stream_id, code)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            pass

    def acknowledge(self, stream_id: int, n: int) -> None:
        try:
            self._conn.acknowledge_received_data(n, stream_id)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            try:  # the stream is closed: the connection window still wants its bytes
                self._conn.increment_flow_control_window(n)
            except (h2.exceptions.ProtocolError, ValueError):
                pass

    def pending(self, stream_id: int) -> int:
        queue = self._queues.get(stream_id)
        return 0 if queue is None else queue.size

    def send_window(self, stream_id: int) -> int:
        try:
            return self._conn.local_flow_control_window(stream_id)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError):
            return 0

    def ping(self, data: bytes) -> None:
        try:
            self._conn.ping(data)
        except h2.exceptions.ProtocolError:
            pass

    @property
    def peer_max_streams(self) -> int:
        return self._conn.remote_settings.max_concurrent_streams

    def goaway_notice(self) -> None:
        self._inject(GoAwayFrame(0, last_stream_id=MAX_STREAM_ID, error_code=0))

    def goaway(self, code: int = ErrorCode.NO_ERROR, debug: bytes = b"") -> None:
        if code != ErrorCode.NO_ERROR:
            self._final_goaway(code, debug)
            return
        self._last_stream_id = self._conn.highest_inbound_stream_id
        frame = GoAwayFrame(0, last_stream_id=self._last_stream_id, error_code=0)
        frame.additional_data = debug
        self._inject(frame)

    def _final_goaway(self, code: int, debug: bytes = b"") -> None:
        try:
            self._conn.close_connection(code, additional_data=debug or None)
        except h2.exceptions.ProtocolError:
            pass

    def _inject(self, frame: GoAwayFrame) -> None:
        """Queue a frame h2 must not know about (a GOAWAY that keeps its streams open)."""
        self._conn._data_to_send += frame.serialize()


def _path_ok(headers: Any) -> bool:
    """Whether ``:path`` is an origin-form path (it starts with ``/``); h2 checks it is there
    and not empty, not its form."""
    for name, value in headers:
        if name == b":path":
            return value[:1] == b"/" or value == b"*"
    return True


__all__ = ["H2Engine"]
