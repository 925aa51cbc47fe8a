"""The device/front-end channel's parts: the arena's slot allocator and the framed channel.

The ring is checked against a model of what it must guarantee (hypothesis drives arbitrary
sequences of allocations and out-of-order frees): no two held slots overlap, a slot lies inside
the arena, and once every slot is back the whole arena can be handed out again. The channel is
run over a real socket pair on both event loops: batches arrive whole and in order whatever
the reads cut them into, and an idle writer does not spin.
"""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.serving.ipc import Arena, Channel, Request, Ring, UnaryCall

SIZE = 4096


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 1500), st.integers(0, 50)), max_size=80))
def test_held_slots_never_overlap_and_the_ring_empties(ops):
    ring = Ring(SIZE)
    held: dict[int, int] = {}
    for alloc, nbytes, pick in ops:
        if alloc or not held:
            slot = ring.alloc(nbytes)
            if slot is None:
                continue
            offset = slot % SIZE
            assert offset + nbytes <= SIZE, "a slot runs past the end of the arena"
            for other, n in held.items():
                a, b = offset, offset + nbytes
                c, d = other % SIZE, other % SIZE + n
                assert b <= c or d <= a, "two held slots overlap"
            held[slot] = nbytes
        else:
            slot = sorted(held)[pick % len(held)]
            del held[slot]
            ring.free(slot)
    for slot in list(held):
        ring.free(slot)
    assert ring.used == 0
    assert ring.alloc(SIZE) is not None, "an empty ring hands out the whole arena"


def test_a_message_larger_than_the_room_left_is_refused_not_wrapped_over_a_held_slot():
    ring = Ring(SIZE)
    first = ring.alloc(3000)
    assert first is not None
    assert ring.alloc(2000) is None  # would need the space the first still holds
    ring.free(first)
    assert ring.alloc(2000) is not None
    assert Ring(SIZE).alloc(SIZE + 1) is None


def test_the_arena_writes_pieces_and_views_them_in_place():
    fd = Arena.create_fd("kserve_trio-test", SIZE)
    try:
        writer, reader = Arena(fd, SIZE), Arena(fd, SIZE)
    finally:
        import os

        os.close(fd)
    ring = Ring(SIZE)
    slot = ring.alloc(10)
    assert slot is not None
    assert writer.write(slot, [b"hello", memoryview(b" wor"), bytearray(b"ld")]) == 11
    assert bytes(reader.view(slot, 11)) == b"hello world"
    writer.close()
    reader.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_batches_arrive_whole_and_in_order(anyio_backend):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left = Channel(await anyio.abc.SocketStream.from_socket(a))
    right = Channel(await anyio.abc.SocketStream.from_socket(b))
    got: list = []
    big = b"x" * (3 << 20)  # larger than one read: a frame cut over several
    async with anyio.create_task_group() as tg:
        tg.start_soon(left.run_writer)
        for i in range(100):
            left.send(Request(i, UnaryCall("ServerLive"), 0, big if i == 50 else b""))
            if i % 7 == 0:
                await anyio.sleep(0)
        async for batch in right.batches():
            got.extend(batch)
            if len(got) == 100:
                break
        tg.cancel_scope.cancel()
    assert [m.id for m in got] == list(range(100))
    assert got[50].payload == big
    assert left.frames_sent < 100, "messages queued together share a frame"
    await left.aclose()
    await right.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_the_reader_ends_when_the_peer_closes(anyio_backend):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    right = Channel(await anyio.abc.SocketStream.from_socket(b))
    a.close()
    with anyio.fail_after(10):
        assert [batch async for batch in right.batches()] == []
    await right.aclose()
