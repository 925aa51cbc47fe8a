"""The reaches below anyio in ``core/process/event_loops.py`` that anyio does not make safe itself: a
socket attribute of a stream whose transport is gone, and a hand-over to the loop from another
thread (the device thread's use of it is tested in tests/worker/test_device_thread.py)."""

from __future__ import annotations

import threading

import anyio
import anyio.abc
import anyio.to_thread
import pytest

from kserve_trio.core.process.event_loops import (
    LoopClosed,
    stream_attribute,
    thread_poster,
    uvloop_available,
)

LOOPS = [("asyncio", {}), ("trio", {})]
if uvloop_available():
    LOOPS.append(("asyncio", {"use_uvloop": True}))


@pytest.mark.parametrize(("backend", "options"), LOOPS)
def test_a_closed_streams_socket_attribute_is_the_default_not_a_crash(backend, options):
    """On uvloop ``extra()`` of a stream whose transport has closed raises AttributeError
    (anyio asks a missing socket for its peer name): found as an HTTP 500 in the gateway's
    REST failover when a worker's REST port closed the connection at once."""
    seen: dict[str, object] = {}

    async def main() -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        stream = await anyio.connect_tcp("127.0.0.1", port)
        live = stream_attribute(stream, anyio.abc.SocketAttribute.raw_socket)
        seen["live_fd"] = live.fileno() if live is not None else None
        await stream.aclose()
        gone = stream_attribute(stream, anyio.abc.SocketAttribute.raw_socket)
        seen["gone_fd"] = gone.fileno() if gone is not None else -1
        seen["peer"] = stream_attribute(stream, anyio.abc.SocketAttribute.remote_address, "")
        await listener.aclose()

    anyio.run(main, backend=backend, backend_options=options)
    assert isinstance(seen["live_fd"], int) and seen["live_fd"] >= 0
    assert seen["gone_fd"] == -1  # no socket, or a closed one: never an exception
    assert seen["peer"] in ("", None) or isinstance(seen["peer"], tuple)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_poster_runs_callbacks_on_the_loop_and_says_when_the_loop_is_gone(backend):
    box: dict[str, object] = {}

    async def main() -> None:
        post = box["post"] = thread_poster()
        loop_thread = threading.get_ident()
        ran = anyio.Event()
        where: list[int] = []

        def callback() -> None:
            where.append(threading.get_ident())
            ran.set()

        await anyio.to_thread.run_sync(post, callback)  # posted from a worker thread
        await ran.wait()
        assert where == [loop_thread]

    anyio.run(main, backend=backend)
    post = box["post"]
    assert callable(post)
    with pytest.raises(LoopClosed):
        post(lambda: None)
