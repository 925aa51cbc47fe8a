"""Fire-and-forget callbacks from a plain thread onto the event loop.

``anyio.from_thread.run_sync`` blocks the calling thread until the loop has run the callback:
for the device thread that is two extra context switches per execution on the hot path. The
event loops anyio runs on both offer a non-blocking, thread-safe "run this soon" (asyncio's
``loop.call_soon_threadsafe``, trio's ``TrioToken.run_sync_soon``); ``notifier(token)`` returns
the right one. This module is the one place our code reaches into a backend's native loop.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio.from_thread
import anyio.lowlevel


def notifier(token: anyio.lowlevel.EventLoopToken) -> Callable[[Callable[[], object]], None]:
    """A thread-safe, non-blocking ``soon(fn)`` that runs ``fn()`` on ``token``'s loop.

    Raises ``RuntimeError`` from ``soon`` when the loop is closed (nobody is waiting then).
    """
    native = token.native_token
    call_soon = getattr(native, "call_soon_threadsafe", None)  # asyncio (incl. uvloop)
    if call_soon is None:
        call_soon = getattr(native, "run_sync_soon", None)  # trio
    if call_soon is None:  # an unknown backend: fall back to the blocking, portable path

        def call_soon(fn):
            anyio.from_thread.run_sync(fn, token=token)

    return call_soon


__all__ = ["notifier"]
