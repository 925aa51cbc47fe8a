"""A gateway in several processes (``processes: N``): one parent supervising N gateway
processes that share the public ports, so the gateway's protocol work spreads over N cores.

- The parent (``serve_processes``) makes a runtime directory, binds the public gRPC (and
  REST) addresses with SO_REUSEPORT without listening (``_ports``: port 0 resolves once, and
  the port stays reserved while a child restarts), writes the resolved configuration there
  and starts the children by exec (``_children``), restarting one that dies, with back-off.
  It serves the one admin port (``_admin``): merged ``/metrics``, ``/healthz``, ``/readyz``,
  ``/routing``. SIGTERM drains every child, kills stragglers and removes everything; a parent
  killed outright leaves its directory to the last child out, or to the next parent.
- Each child is a whole gateway (``server.serve_gateway_async`` given a ``ProcessRole``): its
  own prober, worker connections and routing; it binds the same public ports with
  SO_REUSEPORT and listens (the kernel spreads new connections over the children), serves its
  admin endpoints on a loopback port it announces, and keeps its shared-memory registrations
  in the runtime directory's shared record (``gateway.shm_record``), so a registration made
  through any process is one registration.

Files: ``_layout`` says what lives in the runtime directory and who removes it.
"""

from __future__ import annotations

from kserve_trio.gateway.processes._layout import ProcessRole
from kserve_trio.gateway.processes._parent import (
    CHILD_GRACE_SECONDS,
    RunningProcesses,
    serve_processes,
)

__all__ = ["CHILD_GRACE_SECONDS", "ProcessRole", "RunningProcesses", "serve_processes"]
