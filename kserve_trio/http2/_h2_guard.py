"""The pure-Python engine's defences: a connection's received bytes read frame header by frame
header before h2 parses them.

libnghttp2 bounds what a peer can make it hold or answer with options of its own
(``EngineSettings``); h2 has none of them. h2 buffers a header block (HEADERS, then
CONTINUATION frames until END_HEADERS) whole before it decodes or refuses any of it, and
answers floods of cheap frames one by one. Reading the 9-byte frame headers first lets the
``h2`` engine refuse all of that before h2 buffers or answers it; the bytes then go to h2
unchanged. Each rule broken is a ``Violation``: the GOAWAY code and debug data of the end.

- *Preface*: the client preface must be followed by a SETTINGS frame (PROTOCOL_ERROR).
- *Frame size*: a frame larger than the frame size we advertised is FRAME_SIZE_ERROR at its
  header, before anything else is judged of it (h2 would check it only once the whole frame
  had arrived).
- *Header block*: once the fragments of one header block pass the header list size we
  advertised, or it has more CONTINUATION frames than allowed, ENHANCE_YOUR_CALM
  (``header_block_too_large``). An encoded block is never larger than the list it decodes to
  (HPACK only shrinks it), so a peer within the advertised size never meets this rule.
- *Glitches*: frames that move no request (SETTINGS, PING, PRIORITY, WINDOW_UPDATE, DATA with
  no payload and no END_STREAM, undefined frame types) draw from a bucket of
  ``glitch_rate`` (burst, refill per second); empty is ENHANCE_YOUR_CALM
  (``control_frame_flood``).
- *Settings entries*: a SETTINGS frame of more entries than ``max_settings_entries`` is
  ENHANCE_YOUR_CALM (``too_many_settings``).
- *Resets*: RST_STREAM frames draw from their own bucket of ``reset_rate``; empty is
  ENHANCE_YOUR_CALM (``reset_flood``).

Cost: O(frames in the read); a payload is skipped by arithmetic, never sliced; only a frame
header split across two reads is kept (at most 8 bytes). The clock is read only for a read
that holds frames a bucket counts.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from kserve_trio.http2._engine import EngineSettings, ErrorCode

PREFACE_BYTES = 24
"""``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``: what a client sends before its first frame."""

_HEAD = struct.Struct(">HBBBL")  # length (high 16 bits, low 8 bits), type, flags, stream id
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0, 1, 2, 3, 4
_PING, _WINDOW_UPDATE, _CONTINUATION = 6, 8, 9
_END_STREAM = 0x1
_GLITCHES = frozenset({_PRIORITY, _SETTINGS, _PING, _WINDOW_UPDATE})
_KNOWN = frozenset(range(10))


@dataclass(frozen=True, slots=True)
class Violation:
    """A rule the peer broke: the GOAWAY the connection sends before it closes."""

    code: ErrorCode
    debug: bytes


FRAME_TOO_LARGE = Violation(ErrorCode.FRAME_SIZE_ERROR, b"frame_too_large")
NO_SETTINGS_FIRST = Violation(ErrorCode.PROTOCOL_ERROR, b"preface_not_followed_by_settings")
HEADER_BLOCK_TOO_LARGE = Violation(ErrorCode.ENHANCE_YOUR_CALM, b"header_block_too_large")
GLITCH_FLOOD = Violation(ErrorCode.ENHANCE_YOUR_CALM, b"control_frame_flood")
TOO_MANY_SETTINGS = Violation(ErrorCode.ENHANCE_YOUR_CALM, b"too_many_settings")
RESET_FLOOD = Violation(ErrorCode.ENHANCE_YOUR_CALM, b"reset_flood")


class _Bucket:
    """A token bucket of ``burst`` tokens refilled at ``rate`` per second."""

    __slots__ = ("_burst", "_rate", "_refilled", "_tokens")

    def __init__(self, burst: int, rate: int) -> None:
        self._burst = float(burst)
        self._rate = float(rate)
        self._tokens = float(burst)
        self._refilled = -math.inf

    def draw(self, n: int, now: float) -> bool:
        """Take ``n`` tokens; True when the bucket ran dry."""
        if not self._burst:
            return False
        tokens = min(self._burst, self._tokens + (now - self._refilled) * self._rate) - n
        self._refilled = now
        self._tokens = tokens
        return tokens < 0


class FrameGuard:
    """One connection's frame-header scanner and the rules on it (module docstring)."""

    __slots__ = (
        "_block",
        "_block_cap",
        "_clock",
        "_continuations",
        "_frame_cap",
        "_glitches",
        "_max_continuations",
        "_max_entries",
        "_partial",
        "_preface",
        "_resets",
        "_settings_first",
        "_skip",
    )

    def __init__(
        self,
        settings: EngineSettings,
        clock: Callable[[], float] = time.monotonic,
        *,
        preface: bool = True,
    ) -> None:
        self._clock = clock
        self._preface = PREFACE_BYTES if preface else 0
        self._settings_first = preface  # the first frame after the preface is still to come
        self._skip = 0  # payload bytes of the current frame still to come
        self._partial = b""  # the start of a frame header cut by the end of a read
        self._block = 0  # fragment bytes of the current header block
        self._continuations = 0
        self._frame_cap = settings.max_frame
        self._block_cap = settings.max_header_list or math.inf
        self._max_continuations = settings.max_continuations
        self._max_entries = settings.max_settings_entries
        self._glitches = _Bucket(*settings.glitch_rate)
        self._resets = _Bucket(*settings.reset_rate)

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
                return None
            pos += self._skip
            self._skip = 0
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
        glitches = resets = 0
        while pos + 9 <= end:
            high, low, kind, flags, _ = unpack(data, pos)
            length = (high << 8) | low
            pos += 9 + length
            if self._settings_first:
                if kind != _SETTINGS:
                    return NO_SETTINGS_FIRST
                self._settings_first = False
            if length > self._frame_cap:
                return FRAME_TOO_LARGE
            if kind == _DATA:
                if not length and not flags & _END_STREAM:
                    glitches += 1
            elif kind == _HEADERS or kind == _CONTINUATION:
                if kind == _HEADERS:
                    self._block = length
                    self._continuations = 0
                else:
                    self._block += length
                    self._continuations += 1
                    if self._continuations > self._max_continuations:
                        return HEADER_BLOCK_TOO_LARGE
                if self._block > self._block_cap:
                    return HEADER_BLOCK_TOO_LARGE
            elif kind == _RST_STREAM:
                resets += 1
            elif kind in _GLITCHES:
                glitches += 1
                if kind == _SETTINGS and length // 6 > self._max_entries:
                    return TOO_MANY_SETTINGS
            elif kind not in _KNOWN:
                glitches += 1
        if glitches or resets:
            now = self._clock()
            if glitches and self._glitches.draw(glitches, now):
                return GLITCH_FLOOD
            if resets and self._resets.draw(resets, now):
                return RESET_FLOOD
        return pos


__all__ = [
    "FRAME_TOO_LARGE",
    "GLITCH_FLOOD",
    "HEADER_BLOCK_TOO_LARGE",
    "NO_SETTINGS_FIRST",
    "PREFACE_BYTES",
    "RESET_FLOOD",
    "TOO_MANY_SETTINGS",
    "FrameGuard",
    "Violation",
]
