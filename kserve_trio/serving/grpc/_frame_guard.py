"""The frame guard: a connection's received bytes read frame header by frame header before h2
parses them, and the abuse rules judged on what the headers say.

Why before h2: h2 holds what it cannot act on yet. A header block (HEADERS, then CONTINUATION
frames until END_HEADERS) is buffered whole, up to 64 fragments of the maximum frame size (with
our 1 MiB frames, 64 MiB per connection) before h2 decodes or refuses anything; a frame is
buffered until its last byte arrives. Floods of cheap frames (SETTINGS, PING, PRIORITY,
WINDOW_UPDATE, empty DATA, unknown types) cost h2 a parse and often an answer each. Reading the
9-byte frame headers first lets the connection refuse all of that before h2 buffers or answers
it; the bytes go on to h2 unchanged.

The rules (each one a ``Violation``: the GOAWAY code and debug data the connection sends):

1. Header blocks: once the fragments of one header block (HEADERS and its CONTINUATIONs,
   padding included) pass ``limits.max_header_list_bytes``, GOAWAY(ENHANCE_YOUR_CALM,
   ``header_block_too_large``). It is judged on each frame's header, so a fragment announced
   too large is refused before its payload arrives. An encoded block is never larger than the
   header list it decodes to (HPACK only shrinks: each decoded field also counts 32 bytes), so
   a client within the advertised SETTINGS_MAX_HEADER_LIST_SIZE never meets this rule.
2. Control frames: SETTINGS, PING, PRIORITY, WINDOW_UPDATE, DATA with no payload and no
   END_STREAM, and frame types HTTP/2 does not define draw from a token
   bucket of ``limits.max_control_frames_per_second`` tokens refilled at that rate (a burst of
   one second's worth, then the rate); an empty bucket is GOAWAY(ENHANCE_YOUR_CALM,
   ``control_frame_flood``).
3. Pings (grpc-core's rule): a client PING that arrives less than
   ``limits.min_ping_interval_seconds`` after the previous one, with no DATA or HEADERS frame
   received or sent in between, is a strike; more than ``limits.max_ping_strikes`` strikes is
   GOAWAY(ENHANCE_YOUR_CALM, ``too_many_pings``). DATA or HEADERS either way resets the strikes
   and the ping clock (``SendWatch.payload_sent`` says what the connection sent). PING ACKs
   (answers to the server's keepalive) are never strikes.
4. Handshake: ``handshaken`` turns true once the 24-byte client preface and a whole first
   SETTINGS frame have arrived; the connection's timer closes a connection that is not
   handshaken within ``limits.handshake_seconds``.

Cost: ``scan`` is O(frames in the read). A payload is skipped by arithmetic, never sliced or
copied; only a frame header split across two reads is kept (at most 8 bytes). The clock is read
only for a read that holds control frames or a PING. A small unary request (HEADERS and one
DATA frame, one read) costs two header unpacks.

``ResetJudge`` is the premature-reset rule (Envoy's): the outcomes of a connection's most recent
calls, and whether more than half of them were reset by the client right after opening.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from h2.errors import ErrorCodes

from kserve_trio.core.config import EdgeLimits

PREFACE_BYTES = 24
"""``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``: what a client sends before its first frame."""

_HEAD = struct.Struct(">HBBBL")  # length (high 16 bits, low 8 bits), type, flags, stream id
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0, 1, 2, 3, 4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 5, 6, 7, 8, 9
_END_STREAM = 0x1
_ACK = 0x1
_END_HEADERS = 0x4
_COUNTED = frozenset({_PRIORITY, _SETTINGS, _PING, _WINDOW_UPDATE})
"""Control frames the flood rule counts (PING is also judged by the ping rule)."""
_KNOWN = frozenset(range(10))
MAX_RESET_WINDOW = 1 << 16
"""The most recent calls ``ResetJudge`` remembers per connection, whatever the limit says."""


@dataclass(frozen=True, slots=True)
class Violation:
    """A rule the client broke: the GOAWAY the connection sends before it closes."""

    code: ErrorCodes
    debug: bytes


HEADER_BLOCK_TOO_LARGE = Violation(ErrorCodes.ENHANCE_YOUR_CALM, b"header_block_too_large")
CONTROL_FRAME_FLOOD = Violation(ErrorCodes.ENHANCE_YOUR_CALM, b"control_frame_flood")
TOO_MANY_PINGS = Violation(ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings")
PREMATURE_RESETS = Violation(ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_premature_resets")


class SendWatch(Protocol):
    """What the connection sent: ``payload_sent`` turns true when a DATA or HEADERS frame of
    ours is queued; the guard clears it when it resets the ping strikes."""

    payload_sent: bool


class FrameGuard:
    """One connection's frame-header scanner and the rules on it (module docstring)."""

    __slots__ = (
        "_block",
        "_block_cap",
        "_clock",
        "_last_ping",
        "_max_strikes",
        "_partial",
        "_ping_interval",
        "_preface",
        "_rate",
        "_refilled",
        "_sent",
        "_settings_due",
        "_skip",
        "_strikes",
        "_tokens",
        "handshaken",
    )

    def __init__(
        self,
        limits: EdgeLimits,
        sent: SendWatch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sent = sent
        self._clock = clock
        self._preface = PREFACE_BYTES
        self._skip = 0  # payload bytes of the current frame still to come
        self._partial = b""  # the start of a frame header cut by the end of a read
        self._block = 0  # fragment bytes of the current header block
        self._block_cap = limits.max_header_list_bytes or math.inf
        self._rate = float(limits.max_control_frames_per_second)
        self._tokens = self._rate
        self._refilled = -math.inf
        self._ping_interval = limits.min_ping_interval_seconds
        self._max_strikes = limits.max_ping_strikes
        self._strikes = 0
        self._last_ping = -math.inf
        self._settings_due: bool | None = False  # the first SETTINGS' payload is on its way
        self.handshaken = False

    def scan(self, data: bytes) -> Violation | None:
        """Read the frame headers in ``data`` (the next bytes of the connection); the rule
        broken, if any. Call it before the bytes go to h2."""
        end = len(data)
        pos = 0
        if self._preface:
            pos = min(self._preface, end)
            self._preface -= pos
        if self._skip:
            if self._skip >= end - pos:
                self._skip -= end - pos
                if not self._skip and self._settings_due:
                    self.handshaken = True
                return None
            pos += self._skip
            self._skip = 0
            if self._settings_due:
                self.handshaken = True
        if self._partial:
            head = self._partial + data[pos : pos + 9 - len(self._partial)]
            pos += len(head) - len(self._partial)
            if len(head) < 9:
                self._partial = head
                return None
            self._partial = b""
            after = self._walk(head, 0, 9)
            if isinstance(after, Violation):
                return after
            pos += after - 9
            if pos > end:
                self._skip = pos - end
                return None
        if pos < end:
            after = self._walk(data, pos, end)
            if isinstance(after, Violation):
                return after
            if after > end:
                self._skip = after - end
            elif after < end:
                self._partial = bytes(data[after:end])
        return None

    def _walk(self, data: bytes, pos: int, end: int) -> int | Violation:
        """The frames whose headers start in ``data[pos:end]``; where the next header starts
        (past ``end`` when a payload goes on in the next read), or the rule broken."""
        unpack = _HEAD.unpack_from
        control = 0
        moved = False  # DATA or HEADERS received: the ping strikes start over
        block = self._block
        cap = self._block_cap
        while pos + 9 <= end:
            high, low, kind, flags, _ = unpack(data, pos)
            length = (high << 8) | low
            if not self.handshaken and self._settings_due is False:
                if kind != _SETTINGS:
                    self._settings_due = None  # another frame first: never handshaken
                elif pos + 9 + length <= end:
                    self.handshaken = True
                else:
                    self._settings_due = True
            pos += 9 + length
            if kind == _DATA:
                if length or flags & _END_STREAM:
                    moved = True
                else:
                    control += 1
            elif kind == _HEADERS:
                moved = True
                block = length
                if block > cap:
                    return HEADER_BLOCK_TOO_LARGE
            elif kind == _CONTINUATION:
                block += length
                if block > cap:
                    return HEADER_BLOCK_TOO_LARGE
            elif kind in _COUNTED:
                control += 1
                if kind == _PING and not flags & _ACK:
                    if moved:
                        moved = False
                        self._reset_strikes()
                    if self._ping_struck():
                        return TOO_MANY_PINGS
            elif kind not in _KNOWN:
                control += 1
        self._block = block
        if moved:
            self._reset_strikes()
        if control and self._rate and self._draw(control):
            return CONTROL_FRAME_FLOOD
        return pos

    def _draw(self, n: int) -> bool:
        """Take ``n`` tokens from the control-frame bucket; True when it ran dry."""
        now = self._clock()
        tokens = min(self._rate, self._tokens + (now - self._refilled) * self._rate) - n
        self._refilled = now
        self._tokens = tokens
        return tokens < 0

    def _reset_strikes(self) -> None:
        self._strikes = 0
        self._last_ping = -math.inf
        self._sent.payload_sent = False

    def _ping_struck(self) -> bool:
        """A client PING under the ping rule; True when it is one strike too many."""
        if not self._ping_interval:
            return False
        if self._sent.payload_sent:
            self._reset_strikes()
        now = self._clock()
        if now - self._last_ping < self._ping_interval:
            self._strikes += 1
        self._last_ping = now
        return self._strikes > self._max_strikes


class ResetJudge:
    """Envoy's premature-reset rule for one connection: of its most recent
    ``limits.premature_reset_min_streams`` calls, more than half reset by the client within
    ``limits.premature_reset_seconds`` of opening is too many. ``record`` takes each call's
    outcome as it ends; a ring of outcomes (one byte per call, at most ``MAX_RESET_WINDOW``)
    keeps the count of the recent ones in O(1)."""

    __slots__ = ("_filled", "_pos", "_premature", "_ring", "max_age")

    def __init__(self, limits: EdgeLimits) -> None:
        self._ring = bytearray(min(limits.premature_reset_min_streams, MAX_RESET_WINDOW))
        self._pos = 0
        self._filled = 0
        self._premature = 0
        self.max_age = limits.premature_reset_seconds
        """How young a call reset by the client must be to count as premature."""

    def record(self, premature: bool) -> bool:
        """One call's outcome; True when the connection has now reset too many too early."""
        ring = self._ring
        size = len(ring)
        if not size:
            return False
        pos = self._pos
        self._premature += premature - ring[pos]
        ring[pos] = premature
        self._pos = pos + 1 if pos + 1 < size else 0
        if self._filled < size:
            self._filled += 1
        return self._filled == size and 2 * self._premature > size


__all__ = [
    "CONTROL_FRAME_FLOOD",
    "HEADER_BLOCK_TOO_LARGE",
    "MAX_RESET_WINDOW",
    "PREFACE_BYTES",
    "PREMATURE_RESETS",
    "TOO_MANY_PINGS",
    "FrameGuard",
    "ResetJudge",
    "SendWatch",
    "Violation",
]
