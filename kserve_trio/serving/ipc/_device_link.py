"""``DeviceLink``: a front end's side of the channel to its worker's device process.

A call hands its ``Call`` and message to ``request`` and waits for the ``Answer``: the message
goes into the request arena when it has room (the frame then carries only its slot) or into
the frame itself, and the answer's reply is copied out of the reply arena by the reader, which
returns the slots it copied in one ``Free`` per batch of answers. A call cancelled by its
client sends ``Cancel`` and leaves; its request slot stays held until the device process's
answer says the request is over (the device may still be reading its tensors), so a slot is
never reused under a request that runs. When the device process is gone (the channel closed)
every call still waiting is answered UNAVAILABLE.

``read_hello`` reads the channel's first message before any event loop runs.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import LogSettings
from kserve_trio.core.protocol import Buffer
from kserve_trio.serving.ipc._arena import Arena, Ring
from kserve_trio.serving.ipc._channel import Channel, ChannelClosed, first_batch
from kserve_trio.serving.ipc._messages import (
    Call,
    Cancel,
    Detail,
    Done,
    Drain,
    Free,
    Hello,
    Log,
    Payload,
    Ping,
    Pong,
    Request,
    Slot,
    UnaryCall,
)

DEVICE_GONE_TEXT = "the worker's device process is gone"


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's end as the device process answered it: a gRPC status (0: OK) and its
    message, the reply's bytes and the call's ``Detail``."""

    status: int
    message: str
    reply: bytes
    detail: Detail = None


@dataclass(slots=True)
class _Pending:
    slot: int | None
    done: anyio.Event = field(default_factory=anyio.Event)
    answer: Answer | None = None


def read_hello(sock: socket.socket) -> Hello:
    """The device process's ``Hello`` (the first frame on blocking ``sock``: it says which
    event loop to run); ``ChannelClosed`` when the channel closes first or begins otherwise."""
    first = first_batch(sock)[0]
    if not isinstance(first, Hello):
        raise ChannelClosed(f"the device process's first message is not Hello ({first!r})")
    return first


class DeviceLink:
    """The front end's requests in flight to the device process (module docstring)."""

    def __init__(self, channel: Channel, requests: Arena, replies: Arena) -> None:
        self.channel = channel
        self._requests = requests
        self._ring = Ring(requests.size)
        self._replies = replies
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._gone = False
        self.forwarded = 0
        """Requests sent to the device process (for tests and the log)."""
        self.inline = 0
        """Of those, payloads that did not fit the arena and travelled in the frame."""
        self.served = 0
        """Of those, inference calls, stream messages and REST requests: the idle trim's
        activity (``process_tuning.IdleTrim``; the other gRPC calls, a gateway's probes among
        them, do not count)."""

    @property
    def in_flight(self) -> int:
        """Requests waiting for their answer."""
        return len(self._pending)

    @property
    def request_bytes_held(self) -> int:
        """Bytes of the request arena whose requests the device has not ended yet."""
        return self._ring.used

    async def request(self, call: Call, data: Buffer, deadline_ns: int) -> Answer:
        """Serve ``call`` on ``data`` in the device process and return its answer."""
        if self._gone:
            return Answer(int(StatusCode.UNAVAILABLE), DEVICE_GONE_TEXT, b"")
        self._next_id += 1
        rid = self._next_id
        nbytes = len(data)
        slot = self._ring.alloc(nbytes) if nbytes else None
        if slot is not None:
            self._requests.write(slot, (data,))
            payload: Payload = Slot(slot, nbytes)
        else:
            payload = bytes(data)
            if nbytes:
                self.inline += 1
        pending = _Pending(slot)
        self._pending[rid] = pending
        self.forwarded += 1
        if call.__class__ is not UnaryCall:
            self.served += 1
        self.channel.send(Request(rid, call, deadline_ns, payload))
        try:
            await pending.done.wait()
        except BaseException:
            if pending.answer is None:
                self.channel.send(Cancel(rid))
            raise
        answer = pending.answer
        assert answer is not None
        return answer

    async def run_reader(
        self,
        on_drain: Callable[[], None],
        on_log: Callable[[LogSettings], None],
    ) -> None:
        """Read the device process's messages until it closes the channel (then answer every
        call still waiting UNAVAILABLE and return)."""
        try:
            async for batch in self.channel.batches():
                freed: list[int] = []
                for message in batch:
                    match message:
                        case Done():
                            self._answer(message, freed)
                        case Ping():
                            self.channel.send(Pong(message.seq))
                        case Log():
                            on_log(message.settings)
                        case Drain():
                            on_drain()
                if freed:
                    self.channel.send(Free(tuple(freed)))
        finally:
            self._gone = True
            gone = Answer(int(StatusCode.UNAVAILABLE), DEVICE_GONE_TEXT, b"")
            for pending in self._pending.values():
                pending.answer = gone
                pending.done.set()
            self._pending.clear()

    def _answer(self, done: Done, freed: list[int]) -> None:
        payload = done.payload
        if isinstance(payload, Slot):
            reply = bytes(self._replies.view(payload.position, payload.nbytes))
            freed.append(payload.position)
        else:
            reply = payload
        pending = self._pending.pop(done.id, None)
        if pending is None:
            return  # a cancelled call's late answer
        if pending.slot is not None:
            self._ring.free(pending.slot)
        pending.answer = Answer(done.status, done.message, reply, done.detail)
        pending.done.set()


__all__ = ["DEVICE_GONE_TEXT", "Answer", "DeviceLink", "read_hello"]
