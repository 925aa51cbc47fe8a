"""The accept loop (``serving.accept``) at its limits, on asyncio (uvloop) and trio:

- out of descriptors (a process under an open-file limit just above what it holds, no
  connection cap): a flood of idle connections on the REST or the gRPC listener makes
  ``accept`` fail with EMFILE; the loop sheds what is pending with its spare descriptor
  (counted ``reason="fd_budget"``), so those clients see their connection closed at once, and
  the process keeps serving; once the flood leaves, every descriptor comes back;
- a TLS handshake that never comes on the REST port is closed at ``limits.handshake_seconds``
  (counted ``reason="handshake_timeout"``), and a TLS client is served meanwhile; a request
  head that stops halfway on a kept-alive connection is answered 408 at the same deadline;
- only a bind error is a listen failure (what the worker CLI reports as "cannot serve"):
  the same ``OSError`` from a running server is not.
"""

from __future__ import annotations

import errno
import functools
import json
import ssl
import subprocess
import sys

import anyio
import pytest

from kserve_trio.core.process.config import EdgeLimits, TlsConfig
from kserve_trio.serving.accept import ListenError
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app
from kserve_trio.serving.tls import server_ssl_context
from kserve_trio.worker.cli import listen_failure
from tests.client.test_tls import pki  # noqa: F401  (the session's throwaway PKI)
from tests.edge.idle_flood import Flood
from tests.edge.limited_procs import fresh_get
from tests.edge.memory_probe import fds as descriptors
from tests.waiting import wait_until

HEADROOM = 24
"""Descriptors the EMFILE server may open beyond those it holds once listening."""
ATTACKERS = 80


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loop", ["uvloop", "trio"])
@pytest.mark.parametrize("port", ["http", "grpc"])
def test_out_of_descriptors_a_listener_sheds_the_flood_and_goes_on_serving(loop, port):
    argv = [sys.executable, "-m", "tests.edge.emfile_server", loop, str(HEADROOM)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ports = json.loads(proc.stdout.readline() or "{}")
        assert ports, proc.stderr.read() if proc.stderr else ""
        assert fresh_get(ports["http"], "/stats")[0] == 200  # every loop has run: the baseline
        baseline = descriptors(proc.pid)
        with Flood(ports[port], ATTACKERS) as flood:
            # Whatever is left after the descriptors ran out is closed, not left waiting.
            flood.wait_closed(ATTACKERS - HEADROOM, timeout=20)
            assert proc.poll() is None
            assert descriptors(proc.pid) <= ports["limit"]
        wait_until(lambda: descriptors(proc.pid) <= baseline, 20, "the descriptors back")
        status, body = fresh_get(ports["http"], "/stats")  # and serving again
        assert status == 200
        refused = json.loads(body)
        assert refused.get("fd_budget", 0) >= 1, refused
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


async def _ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b'{"ok": true}')


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_tls_handshake_that_never_comes_is_closed_at_the_deadline(pki):  # noqa: F811
    deadline_seconds = 0.5
    stats = EdgeStats()
    server_ctx = server_ssl_context(TlsConfig(str(pki / "server.pem"), str(pki / "server.key")))
    client_ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    serve = functools.partial(
        serve_app,
        "127.0.0.1",
        0,
        _ok,
        max_body_bytes=1 << 16,
        ssl_context=server_ctx,
        limits=EdgeLimits(handshake_seconds=deadline_seconds),
        stats=stats,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        silent = await anyio.connect_tcp("127.0.0.1", port)
        start = anyio.current_time()
        tls = await anyio.connect_tcp(
            "127.0.0.1", port, ssl_context=client_ctx, tls_standard_compatible=False
        )
        await tls.send(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")  # served meanwhile
        assert (await tls.receive()).startswith(b"HTTP/1.1 200 ")
        await tls.aclose()
        with anyio.fail_after(deadline_seconds + 5), pytest.raises(anyio.EndOfStream):
            await silent.receive()
        assert anyio.current_time() - start >= deadline_seconds * 0.9
        assert stats.refused_connections["handshake_timeout"] == 1
        await silent.aclose()
        tg.cancel_scope.cancel()


def test_only_a_bind_error_is_a_listen_failure():
    taken = ListenError(errno.EADDRINUSE, "REST port 127.0.0.1:1: Address already in use")
    assert listen_failure(taken) is taken
    assert listen_failure(BaseExceptionGroup("tree", [BaseExceptionGroup("g", [taken])])) is taken
    running = OSError(errno.EMFILE, "Too many open files")  # an accept of a running server
    assert listen_failure(running) is None
    assert listen_failure(BaseExceptionGroup("tree", [running])) is None


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_head_that_stops_halfway_gets_408_at_the_deadline():
    deadline_seconds = 0.5
    stats = EdgeStats()
    serve = functools.partial(
        serve_app,
        "127.0.0.1",
        0,
        _ok,
        max_body_bytes=1 << 16,
        limits=EdgeLimits(handshake_seconds=deadline_seconds),
        stats=stats,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        slow = await anyio.connect_tcp("127.0.0.1", port)
        await slow.send(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")  # one whole request: answered
        assert (await slow.receive()).startswith(b"HTTP/1.1 200 ")
        start = anyio.current_time()
        await slow.send(b"GET / HTTP/1.1\r\nHo")  # the next head never ends
        with anyio.fail_after(deadline_seconds + 5):
            answer = await slow.receive()
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                while True:
                    answer += await slow.receive()
        assert answer.startswith(b"HTTP/1.1 408 ") and b"connection: close" in answer
        assert anyio.current_time() - start >= deadline_seconds * 0.9
        assert stats.refused_connections == {"handshake_timeout": 1}
        await slow.aclose()
        tg.cancel_scope.cancel()
