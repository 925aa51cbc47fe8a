"""The event loops the project runs on and whether the optional one is installed: one owner for
the probe the servers, the client's loop thread and the load driver all make."""

from __future__ import annotations

EVENT_LOOPS = ("uvloop", "asyncio", "trio")
"""The event loops our servers run on (``--event-loop``, ``endpoints.event_loop``)."""


def uvloop_available() -> bool:
    """Whether uvloop can be imported (it is optional: not on every platform)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["EVENT_LOOPS", "uvloop_available"]
