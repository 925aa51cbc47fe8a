"""The gateway's scrape of a worker's ``/metrics`` (``admin.scrape``, on ``serving.http``'s
client): the exposition, and a ``ScrapeError`` saying why not, on both anyio backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from kserve_trio.gateway import admin
from kserve_trio.gateway.admin import ScrapeError, scrape
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@asynccontextmanager
async def serving(
    app: Callable[[HttpRequest], Awaitable[HttpResponse]],
) -> AsyncIterator[int]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            lambda task_status: serve_app(
                "127.0.0.1", 0, app, max_body_bytes=1 << 20, task_status=task_status
            )
        )
        yield port
        tg.cancel_scope.cancel()


async def test_scrape_reads_the_exposition_and_closes_the_connection():
    seen: list[HttpRequest] = []

    async def metrics(request: HttpRequest) -> HttpResponse:
        seen.append(request)
        return HttpResponse(200, b"worker_up 1\n", "text/plain; version=0.0.4")

    async with serving(metrics) as port:
        assert await scrape("127.0.0.1", port) == "worker_up 1\n"
    (request,) = seen
    assert (request.method, request.path) == ("GET", "/metrics")
    assert request.headers["connection"] == "close"
    assert request.headers["accept"] == "text/plain"


async def test_scrape_failures_say_why(monkeypatch):
    async def answer(request: HttpRequest) -> HttpResponse:
        if request.headers.get("host", "").endswith(str(slow_port)):
            await anyio.sleep(60)  # far past the 0.2 s timeout: cancelled when the test ends
        return HttpResponse(503, b"not ready", "text/plain")

    slow_port = -1
    async with serving(answer) as port:
        with pytest.raises(ScrapeError, match=rf"127.0.0.1:{port}/metrics answered HTTP 503"):
            await scrape("127.0.0.1", port)
        slow_port = port
        with pytest.raises(ScrapeError, match=r"did not answer within 0\.2s"):
            await scrape("127.0.0.1", port, timeout=0.2)
        slow_port = -1
        monkeypatch.setattr(admin, "MAX_SCRAPE_BYTES", 4)
        with pytest.raises(ScrapeError, match="over 4 bytes"):
            await scrape("127.0.0.1", port)
    with pytest.raises(ScrapeError, match=f"cannot read 127.0.0.1:{port}/metrics"):
        await scrape("127.0.0.1", port)
