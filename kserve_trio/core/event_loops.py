"""The event loops the project runs on and whether the optional one is installed: one owner for
the probe the servers, the client's loop thread and the load driver all make; and the one
reach below anyio's streams that the HTTP/2 connections of both sides use (``asyncio_transport``)."""

from __future__ import annotations

from typing import Any

EVENT_LOOPS = ("uvloop", "asyncio", "trio")
"""The event loops our servers run on (``--event-loop``, ``endpoints.event_loop``)."""


def uvloop_available() -> bool:
    """Whether uvloop can be imported (it is optional: not on every platform)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def asyncio_transport(stream: object) -> tuple[Any, Any] | None:
    """``(transport, protocol)`` of anyio's asyncio TCP stream, whose ``write`` takes the bytes
    synchronously (a write that cannot be cancelled half-way, with no task switch); None for
    any other stream (TLS, trio, a wrapper)."""
    cls = type(stream)
    if cls.__name__ != "SocketStream" or not cls.__module__.startswith("anyio._backends._asyncio"):
        return None
    transport = getattr(stream, "_transport", None)
    protocol = getattr(stream, "_protocol", None)
    if transport is None or not hasattr(protocol, "write_event"):
        return None
    return transport, protocol


__all__ = ["EVENT_LOOPS", "asyncio_transport", "uvloop_available"]
