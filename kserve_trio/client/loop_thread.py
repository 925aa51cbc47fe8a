"""The client's blocking bridge: which event loop the calling thread runs (if any), and the
daemon loop thread that blocking calls (``infer_sync``, ``model_io_spec``) run on.

The loop thread is a daemon thread running an asyncio event loop (uvloop when installed) behind
an anyio ``BlockingPortal``: connections and registrations made by blocking calls live on
between calls, and background tasks (the shm re-probe) are children of that loop, so stopping
the thread cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import sniffio

from kserve_trio.core.process import uvloop_available

T = TypeVar("T")


def current_loop_key() -> object:
    """An object identifying the running event loop (compared by identity)."""
    library = sniffio.current_async_library()
    if library == "asyncio":
        return asyncio.get_running_loop()
    if library == "trio":
        import trio

        return trio.lowlevel.current_trio_token()
    raise RuntimeError(f"unsupported async library {library!r}")


def loop_closed(key: object) -> bool:
    is_closed = getattr(key, "is_closed", None)
    return bool(is_closed()) if callable(is_closed) else False


def in_event_loop() -> str | None:
    """The async library running in this thread, or ``None`` on a plain thread."""
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        pass
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "asyncio"


def refuse_in_event_loop(what: str, alternative: str) -> None:
    """Raise ``RuntimeError`` when a blocking call is made from a thread running an event loop
    (blocking there would stall that loop, or deadlock it if the server shares it)."""
    library = in_event_loop()
    if library is not None:
        raise RuntimeError(
            f"{what} would block this thread's {library} event loop; use {alternative} instead"
        )


class LoopThread:
    """A daemon thread running an event loop (asyncio, uvloop when installed) and a portal.

    Daemon, so it never holds interpreter exit up; the ``atexit`` hook still finds it running
    (daemon threads run until finalization) and uses it to unregister regions.
    """

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._error: BaseException | None = None
        self.loop_key: object | None = None
        self._thread = threading.Thread(target=self._run, name="kserve_trio-client", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._portal is None:
            raise RuntimeError("the kserve_trio client loop failed to start") from self._error

    def _run(self) -> None:
        async def main() -> None:
            async with anyio.from_thread.BlockingPortal() as portal:
                self.loop_key = current_loop_key()
                self._portal = portal
                self._ready.set()
                await portal.sleep_until_stopped()

        try:
            anyio.run(main, backend="asyncio", backend_options={"use_uvloop": uvloop_available()})
        except BaseException as exc:  # reported by the constructor or ignored at shutdown
            self._error = exc
        finally:
            self._ready.set()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        assert self._portal is not None
        return self._portal.call(fn, *args)

    def start_task_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._portal is not None
        self._portal.start_task_soon(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task on the loop (the re-prober included) and end the thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("the kserve_trio client loop cannot stop itself")
        portal = self._portal
        if portal is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):
                portal.call(portal.stop, True)
        self._thread.join(timeout)


__all__ = ["LoopThread", "current_loop_key", "in_event_loop", "loop_closed", "refuse_in_event_loop"]
