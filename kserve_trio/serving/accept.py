"""Accepting connections on a public port: the one accept loop every listener of ours runs
(gRPC on anyio and on asyncio's own transports, REST, the metrics/admin port).

A listener must outlive anything its clients do. So:

1. *Bind errors*: ``bind`` is the only place a port's ``OSError`` becomes fatal (``ListenError``): a
   port that cannot be bound stops the start; once the port is bound, no error of ``accept`` ends
   the server.
2. *Connection cap*: each port caps its open connections (``ConnectionCap``, its share of the
   process's descriptors, ``serving.fd_budget``). At the cap, the longest-idle connection is closed
   to admit the new one (``reason="evicted_idle"``), as nginx and Envoy do: otherwise clients that
   open connections and never use them lock every other client out until the idle deadline. Idle is
   what the server says (``Slot.idle``/``Slot.busy``): a connection with a request or call in
   progress is never evicted. Its server closes it its own way (a gRPC connection with a GOAWAY
   first). At most ``EVICTING_MAX`` evicted connections of a port are still closing at a time (their
   descriptors are in the budget). With none idle, or that many still closing, the new connection is
   accepted and closed at once, counted ``reason="max_connections"``: the client sees its connection
   closed rather than a SYN left in the backlog, and the descriptors the cap protects stay free for
   the connections being served. Before the cap, the port's ``PeerLedger`` (when it has one) may
   refuse the peer address for its connection rate, and says how strictly a peer on probation after
   abuse is judged (``serving.peer_ledger``).
3. *Resource back-off*: an accept that fails for want of descriptors or kernel memory (EMFILE,
   ENFILE, ENOBUFS, ENOMEM) backs off (5 ms, 50 ms, 200 ms) and tries again; the connections being
   served go on. At EMFILE/ENFILE the loop first closes its spare descriptor (``SpareDescriptor``),
   accepts what is pending and closes it (``reason="fd_budget"``), then reopens the spare: a
   level-triggered listener whose backlog cannot be drained would otherwise wake the loop for ever,
   and the clients would wait for a connection nobody will serve.
4. *One connection's fault*: other accept errors (a connection reset while it sat in the backlog,
   ECONNABORTED, the network errors Linux reports on the new socket) concern one connection only:
   skipped (backing off the same way when they repeat, so a listener in a bad state does not spin).

The loop accepts on the listening socket itself (non-blocking ``accept`` first, then a wait
for readability), on asyncio and trio alike, and hands each accepted socket and its ``Slot``
to ``serve``, a task in the caller's task group.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import anyio.lowlevel

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.peer_ledger import PeerLedger, peer_host

log = get_logger("kserve_trio.serving")

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""Accept failures that say the process (or the system) is out of something: back off."""
_DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
BACKOFF_SECONDS = (0.005, 0.05, 0.2)
SHED_BATCH = 64
"""Pending connections closed per EMFILE round, at most (the rest wait for the next one)."""
EVICTING_MAX = 8
"""Evicted connections of one port still closing, at most (*connection cap*): each holds its
descriptor until it is closed, so the budget keeps room for this many per listener beyond its
cap."""


class ListenError(OSError):
    """A port that cannot be bound (taken, an address not local): the one ``OSError`` a CLI
    reports as "cannot serve". Errors of a running server are never this."""


async def bind(
    host: str, port: int, *, reuse_port: bool = False
) -> anyio.abc.Listener[anyio.abc.SocketStream]:
    """A TCP listener on ``host:port`` (every address ``host`` resolves to); ``ListenError``
    when the port cannot be bound."""
    try:
        return await anyio.create_tcp_listener(
            local_host=host, local_port=port, reuse_port=reuse_port
        )
    except OSError as exc:
        raise ListenError(exc.errno, exc.strerror or str(exc)) from None


def listening_sockets(
    listener: anyio.abc.Listener[anyio.abc.SocketStream],
) -> list[socket.socket]:
    """The OS sockets behind a listener from ``bind`` (one per address)."""
    ones = getattr(listener, "listeners", [listener])
    return [one.extra(anyio.abc.SocketAttribute.raw_socket) for one in ones]


class ConnectionCap:
    """The open connections of one port against its cap, and the idle ones among them, longest
    idle first (module docstring, *connection cap*)."""

    def __init__(
        self, cap: int, stats: EdgeStats, name: str, ledger: PeerLedger | None = None
    ) -> None:
        self.cap = cap
        """Open connections allowed; 0: no cap."""
        self.stats = stats
        self.name = name
        self.open = 0
        """Admitted and not yet closed, the evicted ones still closing included."""
        self.evicting = 0
        """Evicted and not yet closed."""
        self.idle: dict[Slot, None] = {}
        """The evictable connections in the order they became idle (a dict keeps it)."""
        self.ledger = ledger if ledger is not None and ledger.enabled else None
        """What each peer address may open (``serving.peer_ledger``); None: no bound."""

    def admit(self, peer: str = "") -> Slot | None:
        """A place for one more connection from ``peer`` (its host), the longest-idle one
        evicted for it at the cap; None: refused (by the peer's ledger first)."""
        strictness = 1
        if self.ledger is not None and peer:
            admitted = self.ledger.admit(peer)
            if admitted is None:
                self.stats.refuse_connection("peer_rate")
                return None
            strictness = admitted
        if self.cap and self.open - self.evicting >= self.cap:
            if not self.idle or self.evicting >= EVICTING_MAX:
                self.stats.refuse_connection("max_connections")
                return None
            self._evict(next(iter(self.idle)))
        self.open += 1
        return Slot(self, peer, strictness)

    def _evict(self, slot: Slot) -> None:
        del self.idle[slot]
        slot.evicted = True
        self.evicting += 1
        self.stats.refuse_connection("evicted_idle")
        slot.evict()

    def release(self, slot: Slot) -> None:
        """``slot``'s connection is closed."""
        self.open -= 1
        self.idle.pop(slot, None)
        if slot.evicted:
            self.evicting -= 1


class Slot:
    """One admitted connection's place under its port's cap: idle (evictable) or busy, as its
    server says, and how it is closed when evicted (module docstring, *connection cap*)."""

    __slots__ = ("_cap", "_evict", "evicted", "peer", "strictness")

    def __init__(self, cap: ConnectionCap, peer: str = "", strictness: int = 1) -> None:
        self._cap = cap
        self._evict: Callable[[], None] | None = None
        self.evicted = False
        self.peer = peer
        """The client's host ('' when unknown)."""
        self.strictness = strictness
        """How strictly its peer's connections are judged (1: off probation; ``PeerLedger``)."""

    def bind(self, evict: Callable[[], None]) -> None:
        """``evict`` closes the connection from now on. The first binding makes it evictable,
        idle since now; a later one only replaces how it is closed (the server's own way, once
        the connection exists)."""
        first = self._evict is None
        self._evict = evict
        if first:
            self.idle()

    def idle(self) -> None:
        """No request or call in progress: evictable, the most recently idle of the port."""
        if self._evict is not None and not self.evicted:
            idle = self._cap.idle
            idle.pop(self, None)
            idle[self] = None

    def busy(self) -> None:
        """A request or call in progress (or the connection closing): not evictable."""
        self._cap.idle.pop(self, None)

    def evict(self) -> None:
        assert self._evict is not None
        self._evict()

    def abused(self) -> None:
        """The server ended this connection for abuse: its peer goes on probation."""
        ledger = self._cap.ledger
        if ledger is not None and self.peer:
            strictness = ledger.abused(self.peer)
            log.info(
                "peer_probation", listener=self._cap.name, peer=self.peer, strictness=strictness
            )

    def release(self) -> None:
        """The connection is closed (what its server still says of it is ignored)."""
        self._cap.release(self)
        self._evict = None


class SpareDescriptor:
    """One descriptor held back so that a listener can still accept (and close) a connection
    when the process has none left (module docstring, *resource back-off*)."""

    def __init__(self) -> None:
        self.fd = -1

    def open(self) -> bool:
        if self.fd < 0:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False
        return True

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _shed(raw: socket.socket, spare: SpareDescriptor, stats: EdgeStats) -> int:
    """Accept and close what is pending on ``raw`` with the spare descriptor's room."""
    shed = 0
    if not spare.open():  # no spare to give up: nothing can be accepted now
        return 0
    spare.close()
    try:
        while shed < SHED_BATCH:
            sock, _ = raw.accept()
            sock.close()
            shed += 1
            stats.refuse_connection("fd_budget")
    except OSError:
        pass
    finally:
        spare.open()
    return shed


Serve = Callable[[socket.socket, Slot], Awaitable[None]]
"""Serves one accepted socket to its end (and closes it, cancelled included), telling its
``Slot`` when the connection is idle and when busy."""


async def accept_loop(
    raw: socket.socket, cap: ConnectionCap, serve: Serve, tg: anyio.abc.TaskGroup
) -> None:
    """Accept on the listening socket ``raw`` until it closes or the caller cancels, serving
    each admitted connection as a task of ``tg`` (module docstring)."""
    spare = SpareDescriptor()
    spare.open()
    failures = 0
    try:
        while True:
            try:
                sock, address = raw.accept()
            except BlockingIOError:
                try:
                    await anyio.wait_readable(raw)
                except Exception:
                    if raw.fileno() < 0:  # the listener closed under us
                        return
                    raise
                continue
            except OSError as exc:
                if raw.fileno() < 0:
                    return
                pause = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
                failures += 1
                if exc.errno not in RESOURCE_ERRNOS:  # *one connection's fault*
                    log.info("accept_skipped", listener=cap.name, error=exc.strerror)
                    await anyio.sleep(pause if failures > 1 else 0)
                    continue
                shed = _shed(raw, spare, cap.stats) if exc.errno in _DESCRIPTOR_ERRNOS else 0
                log.warning(
                    "accept_failed",
                    listener=cap.name,
                    error=exc.strerror,
                    open_connections=cap.open,
                    shed=shed,
                    retry_seconds=pause,
                )
                await anyio.sleep(pause)
                continue
            failures = 0
            slot = cap.admit(peer_host(address))
            if slot is None:
                sock.close()
            else:
                _configure(sock)
                scope = anyio.CancelScope()  # evictable from its accept, idle since then
                slot.bind(scope.cancel)
                tg.start_soon(_served, serve, sock, slot, scope)
            await anyio.lowlevel.checkpoint()
    finally:
        spare.close()


def _configure(sock: socket.socket) -> None:
    """Non-blocking, and no Nagle delay: a reply's head and body leave as they are written."""
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # a connection already reset: its reader finds out
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _served(serve: Serve, sock: socket.socket, slot: Slot, scope: anyio.CancelScope) -> None:
    """``scope``: how the connection is evicted until its server binds a way of its own."""
    try:
        with scope:
            await serve(sock, slot)
    finally:
        slot.release()


__all__ = [
    "BACKOFF_SECONDS",
    "EVICTING_MAX",
    "RESOURCE_ERRNOS",
    "ConnectionCap",
    "ListenError",
    "Slot",
    "SpareDescriptor",
    "accept_loop",
    "bind",
    "listening_sockets",
]
