"""The worker's admission rule over the shared ``serving.admission.Admission``, and the one
message every part of the worker answers with once it is shutting down.

A fixed cap (``endpoints.max_concurrent_requests``, 0 = none): a unary request past it is
refused RESOURCE_EXHAUSTED and counted as shed, a stream's messages wait for a slot instead.
Once the worker drains, new work is UNAVAILABLE ``SHUTTING_DOWN``: admission, a stream's
reader, the front ends (their hello carries the message) and the scheduler, which answers what
is still queued with it.
"""

from __future__ import annotations

from collections.abc import Callable

from kserve_trio.serving.admission import Admission

SHUTTING_DOWN = "server is shutting down"


def worker_admission(
    max_concurrent_requests: int,
    *,
    on_shed: Callable[[], None],
    max_inflight_bytes: int = 0,
    max_inflight_bytes_per_connection: int = 0,
) -> Admission:
    """The worker's admission: the cap of the module docstring; its ``bytes`` cap the request
    bytes in flight (``limits.max_inflight_bytes``, 0 = none) and what one connection's
    arriving messages may hold of them (``limits.max_inflight_bytes_per_connection``)."""
    return Admission(
        lambda: max_concurrent_requests,
        shutting_down=SHUTTING_DOWN,
        over_cap=lambda cap: f"server is at its concurrency cap ({cap} requests in flight)",
        on_shed=on_shed,
        max_inflight_bytes=max_inflight_bytes,
        max_inflight_bytes_per_connection=max_inflight_bytes_per_connection,
    )


__all__ = ["SHUTTING_DOWN", "worker_admission"]
