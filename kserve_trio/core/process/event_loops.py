"""The event loops the project runs on and whether the optional one is installed: one owner for
the probe the servers, the client's loop thread and the load driver all make; the reaches
below anyio's streams that the connections of both sides use (``asyncio_transport``,
``stream_attribute``);
and the one way another thread hands a callback to the loop without waiting for it
(``thread_poster``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sniffio

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


def stream_attribute(stream: Any, attribute: Any, default: Any = None) -> Any:
    """``stream.extra(attribute, default)``, also when the peer has already closed the
    connection: anyio builds every socket attribute of a stream at once, and on a transport
    that is gone its peer-name lookup raises ``AttributeError`` (no socket) rather than the
    ``OSError`` it expects, whatever attribute was asked for."""
    try:
        return stream.extra(attribute, default)
    except AttributeError:
        return default


class LoopClosed(RuntimeError):
    """The event loop a poster belongs to has ended: nobody will run the callback."""


Poster = Callable[[Callable[[], object]], None]
"""Runs a callback on its event loop's thread soon; callable from any thread, never blocks."""


def thread_poster() -> Poster:
    """For the running event loop: a function other threads call to have a callback run on it
    soon, returning at once (asyncio's ``call_soon_threadsafe``, trio's
    ``TrioToken.run_sync_soon``; both wake a sleeping loop through its own self-pipe or
    eventfd). It raises ``LoopClosed`` once the loop is gone. anyio's ``from_thread.run_sync``
    does the same hand-over but blocks the calling thread until the loop has run the callback."""
    if sniffio.current_async_library() == "trio":
        import trio

        run_sync_soon = trio.lowlevel.current_trio_token().run_sync_soon

        def post_trio(callback: Callable[[], object]) -> None:
            try:
                run_sync_soon(callback)
            except trio.RunFinishedError:
                raise LoopClosed("the trio run has finished") from None

        return post_trio
    import asyncio

    call_soon_threadsafe = asyncio.get_running_loop().call_soon_threadsafe

    def post_asyncio(callback: Callable[[], object]) -> None:
        try:
            call_soon_threadsafe(callback)
        except RuntimeError:  # "Event loop is closed"
            raise LoopClosed("the asyncio event loop is closed") from None

    return post_asyncio


__all__ = [
    "EVENT_LOOPS",
    "LoopClosed",
    "Poster",
    "asyncio_transport",
    "stream_attribute",
    "thread_poster",
    "uvloop_available",
]
