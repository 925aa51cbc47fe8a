"""A ``serving.grpc`` server on a background thread's event loop, for tests that need a real
gRPC peer with scripted behaviour (``tests/client/echo_server.py``,
``tests/gateway/fake_worker.py``) whatever backend, thread or process the test itself runs on.

``start()`` binds (port 0 = ephemeral; ``.port`` is the bound one) and returns once the server
listens; ``stop()`` ends it and its loop. Subclasses say what they serve (``methods``), with
which HTTP/2 settings (``settings``), and how they stop:

- by default like a server shutting down: ``GrpcServer.shutdown(stop_grace)``, the two-phase
  GOAWAY, calls in flight finishing for up to ``stop_grace`` seconds;
- with ``stop_like_a_killed_process`` like a process that dies: the listener and every
  connection close at once, with no GOAWAY and no RST_STREAM (the kernel closing a dead
  process's sockets), which is what a client must survive.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any, Self

import anyio
import anyio.abc
import anyio.from_thread

from kserve_trio.serving.grpc import GrpcServer, Method, ServerSettings


class ThreadedGrpcServer:
    """A ``GrpcServer`` on its own thread and asyncio loop (module docstring)."""

    host: str = "127.0.0.1"
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    settings: ServerSettings | None = None
    stop_grace: float = 1.0
    stop_like_a_killed_process: bool = False
    _cm: Any = None
    _portal: anyio.from_thread.BlockingPortal | None = None
    _future: Any = None
    _server: GrpcServer | None = None
    _scope: anyio.CancelScope | None = None

    def methods(self) -> Mapping[str, Method]:
        """Path -> ``Method``: what the server serves."""
        raise NotImplementedError

    @property
    def server(self) -> GrpcServer:
        """The running ``GrpcServer`` (its ``connections``, ``running_calls``)."""
        assert self._server is not None, "the server is not started"
        return self._server

    def start(self) -> Self:
        self._cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        portal = self._portal = self._cm.__enter__()
        try:
            self._future, self.port = portal.start_task(self._run)
        except BaseException:
            self._cm.__exit__(None, None, None)
            self._portal = None
            raise
        return self

    async def _run(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        """The task the portal holds: the server (made here, on its loop) in a scope ``stop``
        can cancel as a whole."""
        self._server = GrpcServer(self.methods(), self.settings)
        with anyio.CancelScope() as scope:
            self._scope = scope
            async with anyio.create_task_group() as tg:
                port = await tg.start(self._server.serve, self.host, self.port, self.ssl_context)
                task_status.started(port)

    async def _stop(self) -> None:
        assert self._server is not None and self._scope is not None
        if self.stop_like_a_killed_process:
            # Cancelling the server's whole task tree closes the listener and every socket
            # without a frame more: no task gets to queue a GOAWAY or an RST_STREAM.
            self._scope.cancel()
        else:
            await self._server.shutdown(self.stop_grace)

    def stop(self) -> None:
        """Stop serving (module docstring) and end the loop; a second call does nothing."""
        portal = self._portal
        if portal is None:
            return
        self._portal = None
        try:
            portal.call(self._stop)
            self._future.result(timeout=10 + self.stop_grace)
        finally:
            self._cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
