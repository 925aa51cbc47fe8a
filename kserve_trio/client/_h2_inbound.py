"""What a client connection does with the frames it receives (``_h2_connection`` reads them;
this is the protocol half, no I/O): a reply's HEADERS, DATA and trailers to its call, resets
and GOAWAY to the calls they end, SETTINGS, PING and WINDOW_UPDATE to the connection's state,
and whatever breaks the protocol as a ``_h2_frames.FrameError`` with its HTTP/2 error code.
Answers (SETTINGS and PING acknowledgements, WINDOW_UPDATEs, RST_STREAMs) are queued on
``out`` for the connection's next flush."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import hpack

from kserve_trio.client import _h2_frames as fr
from kserve_trio.client._h2_call import _Call, _error_name
from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import StatusCode

WINDOW_BYTES = 64 << 20
"""Our receive windows (connection and each stream): a large reply never waits for a
WINDOW_UPDATE round trip."""
DECODED_BLOCKS = 64
"""How many indexed-only reply header blocks a connection keeps decoded."""

_REFUSED = 0x7  # REFUSED_STREAM
Buffer = bytes | bytearray | memoryview


class Inbound:
    """The receiving half of a ``Connection``: its state that frames change, and ``dispatch``."""

    address: str
    calls: dict[int, _Call]
    parked: set[_Call]
    draining: bool

    def __init__(self) -> None:
        self.out: list[Buffer] = []  # frames queued for the socket
        self.decoder = hpack.Decoder()
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}  # indexed-only blocks
        self.max_streams = 1 << 32  # the peer's SETTINGS_MAX_CONCURRENT_STREAMS
        self.max_frame = fr.DEFAULT_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.initial_window = fr.DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.send_window = fr.DEFAULT_WINDOW  # the connection's send window
        self.unacked = 0  # DATA received on the connection, not yet given back
        self.continued: tuple[int, int, list[bytes]] | None = None  # a header block in parts

    def dispatch(self, frames: Sequence[tuple[int, int, int, memoryview]]) -> None:
        """Apply each frame to the connection or its call; wake the calls whose state changed."""
        calls = self.calls
        wake_parked = False
        for ftype, flags, sid, payload in frames:
            if self.continued is not None and ftype != fr.CONTINUATION:
                raise fr.FrameError(fr.PROTOCOL_ERROR, "a header block was interrupted")
            if ftype == fr.DATA:
                if sid == 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "DATA on stream 0")
                self._data(calls.get(sid), flags, payload)
            elif ftype == fr.HEADERS:
                if sid == 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "HEADERS on stream 0")
                block = fr.unpad(payload, flags)
                if flags & fr.PRIORITY_FLAG:
                    block = block[5:]
                if flags & fr.END_HEADERS:
                    self._headers(sid, flags, block)
                else:
                    self.continued = (sid, flags, [bytes(block)])
            elif ftype == fr.CONTINUATION:
                if self.continued is None or self.continued[0] != sid:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
                self.continued[2].append(bytes(payload))
                if flags & fr.END_HEADERS:
                    first_flags, parts = self.continued[1], self.continued[2]
                    self.continued = None
                    self._headers(sid, first_flags, b"".join(parts))
            elif ftype == fr.RST_STREAM:
                if len(payload) != 4:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "an RST_STREAM frame not 4 bytes")
                call = calls.get(sid)
                if call is not None:
                    call.remote_closed = call.local_closed = True
                    if not call.done:
                        code = fr.u32(payload)
                        call.reset_code = code
                        call.refused = code == _REFUSED
                        call.done = True
                        _wake(call)
            elif ftype == fr.SETTINGS:
                if sid != 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "SETTINGS on a stream")
                if not flags & fr.ACK:
                    self._settings(payload)
                    wake_parked = True
            elif ftype == fr.WINDOW_UPDATE:
                if len(payload) != 4:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame not 4 bytes")
                increment = fr.u32(payload) & fr.MAX_WINDOW
                if sid == 0:
                    if increment == 0:
                        raise fr.FrameError(fr.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
                    self.send_window += increment
                    if self.send_window > fr.MAX_WINDOW:
                        raise fr.FrameError(fr.FLOW_CONTROL_ERROR, "the send window overflowed")
                else:
                    call = calls.get(sid)
                    if call is not None:
                        call.window += increment
                wake_parked = True
            elif ftype == fr.PING:
                if len(payload) != 8:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a PING frame not 8 bytes")
                if not flags & fr.ACK:
                    self.out.append(fr.frame(fr.PING, fr.ACK, 0, bytes(payload)))
            elif ftype == fr.GOAWAY:
                if len(payload) < 8:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a GOAWAY frame under 8 bytes")
                self.goaway(fr.u32(payload) & fr.MAX_STREAM_ID, fr.u32(payload, 4))
                wake_parked = True
            elif ftype == fr.PUSH_PROMISE:
                raise fr.FrameError(fr.PROTOCOL_ERROR, "PUSH_PROMISE, which we disabled")
            # PRIORITY and unknown frame types are ignored
        if wake_parked:
            for call in self.parked:
                _wake(call)

    def _data(self, call: _Call | None, flags: int, payload: memoryview) -> None:
        size = len(payload)  # padding included: all of it counts against the windows
        self.unacked += size
        if self.unacked >= WINDOW_BYTES // 2:
            self.out.append(fr.window_update(0, self.unacked))
            self.unacked = 0
        if call is None or call.done:
            return  # a stream already answered or reset: the bytes only count for the window
        body = fr.unpad(payload, flags)
        if not call.data(body):
            call.done = True
            self.reset(call)
            _wake(call)
            return
        if flags & fr.END_STREAM:
            call.remote_closed = call.done = True
            _wake(call)
            return
        call.unacked += size
        if call.unacked >= WINDOW_BYTES // 2:
            self.out.append(fr.window_update(call.stream_id, call.unacked))
            call.unacked = 0

    def _headers(self, sid: int, flags: int, block: bytes | memoryview) -> None:
        # every block is decoded, a closed stream's too, to keep the HPACK table in step; a
        # server answers each call with the same few indexed-only blocks, decoded once
        key = bytes(block)
        headers = self.decoded.get(key)
        if headers is None:
            headers = self.decoder.decode(key, raw=True)  # type: ignore[assignment]
            if fr.indexed_only(key):
                if len(self.decoded) >= DECODED_BLOCKS:
                    self.decoded.clear()
                self.decoded[key] = headers  # type: ignore[assignment]
            else:  # the table may have changed: what the cached blocks meant, too
                self.decoded.clear()
        call = self.calls.get(sid)
        if call is None:
            return
        if not call.done:
            call.headers(headers)  # type: ignore[arg-type]
        if flags & fr.END_STREAM:
            call.remote_closed = True
            if not call.done:
                call.done = True
                _wake(call)

    def _settings(self, payload: memoryview) -> None:
        for key, value in fr.settings_values(payload):
            if key == fr.INITIAL_WINDOW_SIZE:
                if value > fr.MAX_WINDOW:
                    raise fr.FrameError(fr.FLOW_CONTROL_ERROR, f"an initial window of {value}")
                delta = value - self.initial_window
                self.initial_window = value
                for call in self.calls.values():
                    call.window += delta
            elif key == fr.MAX_FRAME_SIZE:
                if not fr.DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, f"a max frame size of {value}")
                self.max_frame = value
            elif key == fr.MAX_CONCURRENT_STREAMS:
                self.max_streams = value
        self.out.append(fr.SETTINGS_ACK)

    def goaway(self, last_stream_id: int | None, error_code: int | None) -> None:
        """GOAWAY: no new streams here; streams above ``last_stream_id`` were not processed
        (retry-safe); the others may still complete."""
        self.draining = True
        last = last_stream_id if last_stream_id is not None else 0
        reason = _error_name(error_code) if error_code is not None else "no error code"
        for sid, call in self.calls.items():
            if sid > last and not call.done:
                call.fail(
                    RpcError(
                        StatusCode.UNAVAILABLE,
                        f"{self.address} is going away ({reason}); the call was not processed",
                        method=call.rpc,
                    ),
                    refused=True,
                )
                _wake(call)

    def reset(self, call: _Call) -> None:
        """Queue RST_STREAM CANCEL for ``call``'s stream (if it is still open)."""
        if call.stream_id and not (call.local_closed and call.remote_closed):
            call.local_closed = call.remote_closed = True
            self.out.append(fr.rst_stream(call.stream_id, fr.CANCEL))


def _wake(call: _Call) -> None:
    event: anyio.Event | None = call.event
    if event is not None:
        event.set()


__all__ = ["DECODED_BLOCKS", "WINDOW_BYTES", "Inbound"]
