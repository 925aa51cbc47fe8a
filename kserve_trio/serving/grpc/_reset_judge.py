"""Envoy's premature-reset rule for one connection (``ResetJudge``).

A client that opens streams and resets them at once (rapid reset, MadeYouReset) makes the server
start work it never finishes; one that cancels now and then does not. The judge keeps the
outcomes of a connection's most recent calls and says when more than half of them were reset
by the client right after opening.
"""

from __future__ import annotations

from kserve_trio.core.process import EdgeLimits
from kserve_trio.serving.peer_ledger import judged_streams

MAX_RESET_WINDOW = 1 << 16
"""The most recent calls ``ResetJudge`` remembers per connection, whatever the limit says."""


class ResetJudge:
    """Envoy's premature-reset rule for one connection: of its most recent
    ``limits.premature_reset_min_streams`` calls, more than half reset by the client within
    ``limits.premature_reset_seconds`` of opening is too many. ``record`` takes each call's
    outcome as it ends; a ring of outcomes (one byte per call, at most ``MAX_RESET_WINDOW``)
    keeps the count of the recent ones in O(1)."""

    __slots__ = ("_filled", "_pos", "_premature", "_ring", "max_age")

    def __init__(self, limits: EdgeLimits, strictness: int = 1) -> None:
        """``strictness``: the peer's probation (``serving.peer_ledger``), which shrinks the
        window of judged calls."""
        window = judged_streams(limits.premature_reset_min_streams, strictness)
        self._ring = bytearray(min(window, MAX_RESET_WINDOW))
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


__all__ = ["MAX_RESET_WINDOW", "ResetJudge"]
