"""What one peer address may open: new connections per second, and probation after abuse.

The per-connection defences (the premature-reset rule, the reset, ping and control-frame rates)
end an abusive connection with GOAWAY(ENHANCE_YOUR_CALM). A client that reconnects at once
starts each new connection with a clean record, so a flood spread over reconnections (rapid
reset, MadeYouReset) keeps a core busy and a legitimate client's tail latency high while no
single connection looks bad for long. The ledger remembers the peer address instead:

1. *Rate*: a peer may open ``limits.max_connections_per_peer_per_second`` connections per
   second on a port (a token bucket holding one second's worth; 0: no bound).
2. *Probation*: a peer one of whose connections was ended for abuse (``PeerLedger.abused``) is
   on probation for ``limits.peer_probation_seconds`` after its latest abuse, with a
   *strictness* that doubles per abuse (``MAX_STRICTNESS`` at most): its new connections are
   judged over ``1/strictness`` of the premature-reset window (``MIN_JUDGED_STREAMS`` at least)
   and it may open ``1/strictness`` of the connection rate. A flood that reconnects thus gets
   a few streams per connection and a few connections per second after its first offences
   instead of hundreds each time.

Probation, not a ban: the peer's well-behaved connections are served as before (a client that
cancels now and then never meets the premature-reset rule, however strict), so a gateway or a
load balancer carrying many clients from one address is not cut off for what one of them
did. A refused connection is accepted and closed at once, counted in the port's refused
connections with ``reason="peer_rate"``. The ledger is per listening port and process and
holds at most ``MAX_PEERS`` addresses (the least recently seen forgotten first), so many
addresses cannot grow it without bound.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_PEERS = 4096
"""Peer addresses remembered per port, at most."""
MAX_STRICTNESS = 64
"""Probation's strictness doubles per abuse up to this (*probation*)."""
MIN_JUDGED_STREAMS = 8
"""The premature-reset window on probation never shrinks below this many streams."""


@dataclass
class _Peer:
    tokens: float
    refilled: float
    strictness: int = 1
    last_abuse: float = float("-inf")


class PeerLedger:
    """*Rate* and *probation* of the module docstring for one port."""

    def __init__(
        self,
        connections_per_second: float,
        probation_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = connections_per_second
        self.probation = probation_seconds
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return bool(self.rate or self.probation)

    def _peer(self, host: str, now: float) -> _Peer:
        peer = self._peers.get(host)
        if peer is None:
            peer = self._peers[host] = _Peer(tokens=self.rate, refilled=now)
            if len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(host)
            if peer.strictness > 1 and now - peer.last_abuse > self.probation:
                peer.strictness = 1  # probation served
        return peer

    def admit(self, host: str) -> int | None:
        """A new connection from ``host``: its strictness (1 off probation), or None when
        the peer's rate refuses it (*rate*, divided by the strictness on probation)."""
        now = self._clock()
        peer = self._peer(host, now)
        if self.rate:
            rate = self.rate / peer.strictness
            peer.tokens = min(rate, peer.tokens + (now - peer.refilled) * rate)
            peer.refilled = now
            if peer.tokens < 1.0:
                return None
            peer.tokens -= 1.0
        return peer.strictness

    def abused(self, host: str) -> int:
        """One of ``host``'s connections was ended for abuse (*probation*); its strictness now."""
        if not self.probation:
            return 1
        now = self._clock()
        peer = self._peer(host, now)
        peer.strictness = min(peer.strictness * 2, MAX_STRICTNESS)
        peer.tokens = min(peer.tokens, self.rate / peer.strictness)
        peer.last_abuse = now
        return peer.strictness


def judged_streams(window: int, strictness: int) -> int:
    """The premature-reset window of a connection whose peer has ``strictness`` (*probation*)."""
    if strictness <= 1:
        return window
    return min(window, max(MIN_JUDGED_STREAMS, window // strictness))


def peer_host(address: object) -> str:
    """The host part of a socket's peer address (``(host, port[, ...])``; '' when unknown)."""
    if isinstance(address, tuple) and address:
        return str(address[0])
    return ""


__all__ = [
    "MAX_PEERS",
    "MAX_STRICTNESS",
    "MIN_JUDGED_STREAMS",
    "PeerLedger",
    "judged_streams",
    "peer_host",
]
