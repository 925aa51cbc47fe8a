"""One process's file descriptors, split before anything opens them.

A server process holds descriptors for four things: the connections of its public listeners,
the clients' shared-memory regions (the worker: one descriptor per registered region), the
files it reads while loading models, and its own connections to other processes (the gateway's
worker connections). When the process runs out, ``accept`` fails with EMFILE and so does every
``open``: a model cannot load, a region cannot register. So the limit is split up front, and each
listener caps its connections at its share, whatever the clients do.

The rule (``FdBudget.plan``), for a soft ``RLIMIT_NOFILE`` of ``L``:

- a reserve of ``max(64, L // 16)`` descriptors for the runtime itself (the event loop, logs,
  pipes, imports, the metrics scrape's own client), plus per listener one spare (it lets a
  listener accept and close a connection even at EMFILE) and ``EVICTING_MAX`` for the idle
  connections being closed to admit new ones at the cap (``serving.accept``);
- the worker: ``L // 4`` (at least 16) shared-memory regions (``core.memory.shm.ShmRegistry``) and
  ``L // 16`` for model files;
- the gateway: ``L // 4`` for its connections to the workers;
- what is left, split evenly among the process's listeners: each caps its open connections
  at ``min(limits.max_connections, share)`` (``connection_cap``).

At 1024 a worker with three listeners gets 204 connections per listener; at 256, 28.

``raise_open_file_limit`` runs first, at process start (the worker and gateway CLIs): the soft
limit goes up to the hard one, as nginx's ``worker_rlimit_nofile`` does when set, since the
soft default (1024 on most distributions) is a compatibility value for ``select``, which
nothing here uses.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.accept import EVICTING_MAX

log = get_logger("kserve_trio.serving")

UNLIMITED_AS = 1 << 20
"""The limit assumed when ``RLIMIT_NOFILE`` reports no limit (the kernel's usual nr_open)."""
MIN_RESERVE = 64
"""Descriptors kept for the runtime whatever the limit."""


def open_file_limit() -> int:
    """The process's soft ``RLIMIT_NOFILE`` now."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_AS if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def raise_open_file_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (logged); returns the soft limit in
    force afterwards. A system that refuses keeps the old limit (logged as a warning)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        log.info("open_file_limit", soft=soft, hard=hard, raised=False)
        return open_file_limit()
    target = UNLIMITED_AS if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open_file_limit_not_raised", soft=soft, hard=hard, error=str(exc))
        return open_file_limit()
    log.info("open_file_limit", soft=target, hard=hard, raised=True, was=soft)
    return open_file_limit()


@dataclass(frozen=True)
class FdBudget:
    """How one process's descriptors are split (module docstring)."""

    limit: int
    """The soft ``RLIMIT_NOFILE`` the split was made from."""
    reserve: int
    """For the runtime itself, the listeners' spares and evictions included."""
    shm_regions: int
    """Shared-memory regions the worker may hold (one descriptor each); 0 for the gateway."""
    model_files: int
    """Kept for loading models (the worker); 0 for the gateway."""
    upstream: int
    """The gateway's connections to its workers; 0 for the worker."""
    per_listener: int
    """Each listener's share of what is left: its connection cap at most."""

    @classmethod
    def plan(
        cls, limit: int, *, listeners: int, worker: bool = False, gateway: bool = False
    ) -> FdBudget:
        """The split of ``limit`` descriptors for a process with ``listeners`` public
        listeners (module docstring)."""
        listeners = max(1, listeners)
        reserve = max(MIN_RESERVE, limit // 16) + listeners * (1 + EVICTING_MAX)
        shm_regions = max(16, limit // 4) if worker else 0
        model_files = limit // 16 if worker else 0
        upstream = limit // 4 if gateway else 0
        left = limit - reserve - shm_regions - model_files - upstream
        return cls(
            limit=limit,
            reserve=reserve,
            shm_regions=shm_regions,
            model_files=model_files,
            upstream=upstream,
            per_listener=max(1, left // listeners),
        )

    def connection_cap(self, max_connections: int) -> int:
        """One listener's cap: ``limits.max_connections`` (0: no limit of its own) bounded by
        the listener's share."""
        if max_connections <= 0:
            return self.per_listener
        return min(max_connections, self.per_listener)

    def log(self, what: str, max_connections: int) -> None:
        log.info(
            "fd_budget",
            process=what,
            limit=self.limit,
            reserve=self.reserve,
            shm_regions=self.shm_regions or None,
            model_files=self.model_files or None,
            upstream=self.upstream or None,
            connections_per_listener=self.connection_cap(max_connections),
        )


__all__ = ["FdBudget", "open_file_limit", "raise_open_file_limit"]
