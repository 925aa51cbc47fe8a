"""Running a server's async context on an event loop of its own: on the calling thread until
SIGINT or SIGTERM, or on a background thread behind a handle that stops it.

The worker and the gateway are each an async context manager that yields a handle once their
ports are open and drains on exit (``worker.server.serve_async``,
``gateway.server.serve_gateway_async``). Their blocking and non-blocking ``serve`` entry points
differ only in which context they enter, so the event loop choice (``EVENT_LOOPS``: uvloop when
installed, asyncio, or trio), the signal wait and the start/stop handshake with a background
thread live here once: a server's event loop is chosen and started here, and what differs per
loop below anyio is ``core.process.event_loops``'.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from kserve_trio.core.process import EVENT_LOOPS, uvloop_available
from kserve_trio.http2 import DEFAULT_ENGINE, ENGINES

T = TypeVar("T")

_OFF = ("0", "false", "no", "off")


def default_event_loop() -> str:
    """uvloop when it is installed and ``KSERVE_TRIO_UVLOOP`` does not turn it off (it halves
    the event loop's own cost per request), else asyncio."""
    if os.environ.get("KSERVE_TRIO_UVLOOP", "1").strip().lower() in _OFF:
        return "asyncio"
    return "uvloop" if uvloop_available() else "asyncio"


def run_loop(fn: Callable[..., Awaitable[Any]], *args: Any, event_loop: str | None = None) -> Any:
    """``anyio.run`` on ``event_loop`` (one of ``EVENT_LOOPS``; None: ``default_event_loop``).
    uvloop asked for but not installed runs on asyncio."""
    loop = event_loop or default_event_loop()
    if loop not in EVENT_LOOPS:
        raise ValueError(f"unknown event loop {loop!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if loop == "trio":
        return anyio.run(fn, *args, backend="trio")
    use_uvloop = loop == "uvloop" and uvloop_available()
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": use_uvloop})


def running_event_loop() -> str:
    """Which of ``EVENT_LOOPS`` the calling task runs on (for the start-up log line)."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        return "trio"
    import asyncio

    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def add_event_loop_flags(parser: argparse.ArgumentParser, config_key: str) -> None:
    """``--event-loop`` and its old synonym ``--no-uvloop`` on a server CLI."""
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help=f"event loop to serve on (default: uvloop when installed; {config_key})",
    )
    parser.add_argument("--no-uvloop", action="store_true", help="the same as --event-loop asyncio")


def add_http2_engine_flag(parser: argparse.ArgumentParser, config_key: str) -> None:
    """``--http2-engine`` on a server CLI: the HTTP/2 engine under its gRPC port."""
    parser.add_argument(
        "--http2-engine",
        choices=ENGINES,
        help=f"HTTP/2 engine of the gRPC port (default {DEFAULT_ENGINE}; {config_key})",
    )


def event_loop_from_args(args: argparse.Namespace) -> str | None:
    """The event loop the flags of ``add_event_loop_flags`` ask for (None: not given)."""
    if getattr(args, "event_loop", None):
        return args.event_loop
    if getattr(args, "no_uvloop", False):
        return "asyncio"
    return None


SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def shutdown_signals() -> Iterator[AsyncIterator[int]]:
    """SIGINT and SIGTERM as they come, for a process that stops on them; once the block is
    left they are ignored until the process exits.

    The default action would kill the process in the middle of the clean-up that follows
    (shared memory, sockets, runtime files), and such signals do come again: a parent killed
    outright sends its death signal once for each of its threads. (asyncio's receiver puts
    the default action back when it closes, so ignoring is set again right after.)"""
    with anyio.open_signal_receiver(*SHUTDOWN_SIGNALS) as signals:
        yield signals
    for signum in SHUTDOWN_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


async def serve_until_signal(server: AbstractAsyncContextManager[object], log: Any) -> None:
    """Hold ``server`` open until the first SIGINT or SIGTERM, then leave it (which drains).

    The signals are caught from before the server starts until it has drained. One that comes
    during the start-up cancels the start (the server's own clean-up runs; nothing it started
    is orphaned) and the process exits 0. Any later one is logged and ignored: the default
    action would kill the process in the middle of its drain and skip the clean-up that
    removes its shared memory, sockets and runtime files (``shutdown_signals``)."""
    starting = anyio.CancelScope()
    stop = anyio.Event()
    serving = False

    async def run_server() -> None:
        nonlocal serving
        with starting:
            async with server:
                serving = True
                await stop.wait()

    failed: list[Exception] = []  # re-raised bare, not in the task group's ExceptionGroup
    with shutdown_signals() as signals:
        async with anyio.create_task_group() as tg:

            async def serve_then_stop_listening() -> None:
                try:
                    await run_server()
                except Exception as exc:  # a start-up error the CLI reports (ListenError, ...)
                    failed.append(exc)
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(serve_then_stop_listening)
            async for signum in signals:
                name = signal.Signals(signum).name
                if stop.is_set() or starting.cancel_called:
                    log.info("shutdown_signal_ignored", signal=name, reason="already stopping")
                elif serving:
                    log.info("shutdown_signal", signal=name)
                    stop.set()
                else:
                    log.info("shutdown_signal", signal=name, during_startup=True)
                    starting.cancel()
    if failed:
        raise failed[0]


@dataclass
class BackgroundLoop(Generic[T]):
    """A server context held open on a thread with its own event loop.

    ``value`` is what the context yielded; ``error`` is what ended the loop, if anything did.
    """

    value: T
    thread: threading.Thread
    token: anyio.lowlevel.EventLoopToken
    stop_event: anyio.Event
    box: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> BaseException | None:
        return self.box.get("error")

    def stop(self, timeout: float, what: str) -> None:
        """Ask the loop to leave the context (it drains), wait for the thread to end, and raise
        ``TimeoutError`` naming ``what`` when it has not ended within ``timeout`` seconds."""
        if self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop may have just ended
                anyio.from_thread.run_sync(self.stop_event.set, token=self.token)
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"{what} did not stop within {timeout}s")


class RunningHandle:
    """What the handle of a running server (a worker's ``RunningServer``, a gateway's
    ``RunningGateway``) knows about where it listens and the loop it runs on; the dataclass
    that derives from it declares the fields."""

    host: str
    port: int
    _loop: BackgroundLoop[Any] | None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def _thread(self) -> threading.Thread | None:
        """The background thread of a non-blocking start; None for a blocking one."""
        return self._loop.thread if self._loop is not None else None

    @property
    def _portal(self) -> anyio.lowlevel.EventLoopToken | None:
        """The token of the background loop (for ``anyio.from_thread`` calls into it)."""
        return self._loop.token if self._loop is not None else None


def start_in_thread(
    open_server: Callable[[], AbstractAsyncContextManager[T]],
    *,
    thread_name: str,
    what: str,
    event_loop: str | None = None,
) -> BackgroundLoop[T]:
    """Enter ``open_server()`` on a new daemon thread's event loop and return once it yielded.

    A context that fails before yielding re-raises its error here (or a ``RuntimeError`` saying
    ``what`` failed to start), so a caller never gets a handle to a server that is not up.
    """
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop_event = anyio.Event()
        box["token"] = anyio.lowlevel.current_token()
        box["stop_event"] = stop_event
        async with open_server() as value:
            box["value"] = value
            ready.set()
            await stop_event.wait()

    def target() -> None:
        try:
            run_loop(main, event_loop=event_loop)
        except BaseException as exc:  # surfaced to the caller of start_in_thread / stop
            box["error"] = exc
        finally:
            ready.set()

    thread = threading.Thread(target=target, name=thread_name, daemon=True)
    thread.start()
    ready.wait()
    if "value" not in box:
        thread.join()
        raise box.get("error") or RuntimeError(f"{what} failed to start")
    return BackgroundLoop(
        value=box["value"],
        thread=thread,
        token=box["token"],
        stop_event=box["stop_event"],
        box=box,
    )


__all__ = [
    "EVENT_LOOPS",
    "BackgroundLoop",
    "RunningHandle",
    "add_event_loop_flags",
    "default_event_loop",
    "event_loop_from_args",
    "run_loop",
    "running_event_loop",
    "serve_until_signal",
    "shutdown_signals",
    "start_in_thread",
    "uvloop_available",
]
