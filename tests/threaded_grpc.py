"""A grpclib server on a background thread's event loop, for tests that need a real gRPC peer
with scripted behaviour (``tests/client/echo_server.py``, ``tests/gateway/fake_worker.py``).

``start()`` binds (port 0 = ephemeral; ``.port`` is the bound one) and returns once the server
listens; ``stop()`` closes it and ends the loop, which drops open connections. Subclasses say
which servables to serve (``servables``) and may drop connections on stop themselves
(``_closing``) to stop like a killed process.
"""

from __future__ import annotations

import ssl
from typing import Any

import anyio.from_thread
import grpclib.server


class ThreadedGrpcServer:
    host: str = "127.0.0.1"
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    server_class: type[grpclib.server.Server] = grpclib.server.Server
    _cm: Any = None
    _portal: Any = None
    _server: Any = None

    def servables(self) -> list[Any]:
        raise NotImplementedError

    def _closing(self, server: grpclib.server.Server) -> None:
        """Called after ``server.close()``, before waiting for it to close."""

    def start(self) -> Any:
        self._cm = anyio.from_thread.start_blocking_portal(backend="asyncio")
        self._portal = self._cm.__enter__()
        self._portal.call(self._start)
        return self

    async def _start(self) -> None:
        self._server = self.server_class(self.servables())
        await self._server.start(self.host, self.port, ssl=self.ssl_context)
        self.port = self._server._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self._closing(self._server)
        await self._server.wait_closed()

    def stop(self) -> None:
        """Stop serving and end the loop (the loop's close drops open connections)."""
        if self._portal is not None:
            self._portal.call(self._stop)
            self._cm.__exit__(None, None, None)
            self._portal = None

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
