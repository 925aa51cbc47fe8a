"""``DeviceLink``: a front end's side of the channel to its worker's device process.

A call hands its request to ``request`` and waits for the answer: the message goes into the
request arena when it has room (the frame then carries only its slot) or into the frame
itself, and the answer's reply is copied out of the reply arena by the reader, which returns
the slots it copied in one ``FREE`` message per batch of answers. A call cancelled by its
client sends ``CANCEL`` and leaves; its request slot stays held until the device process's
answer says the request is over (the device may still be reading its tensors), so a slot is
never reused under a request that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from kserve_trio.serving.ipc import (
    CANCEL,
    DONE,
    DRAIN,
    FREE,
    KIND_UNARY,
    LOG,
    PING,
    PONG,
    REQUEST,
    Arena,
    Channel,
    Ring,
)

Answer = tuple[int, str, bytes, Any]
"""``(status, message, reply, extra)`` of one request (``serving.ipc`` ``DONE``)."""


@dataclass(slots=True)
class _Pending:
    slot: int | None
    done: anyio.Event = field(default_factory=anyio.Event)
    answer: Answer | None = None


class DeviceLink:
    """The front end's requests in flight to the device process (module docstring)."""

    def __init__(self, channel: Channel, requests: Arena, replies: Arena) -> None:
        self.channel = channel
        self._requests = requests
        self._ring = Ring(requests.size)
        self._replies = replies
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self.forwarded = 0
        """Requests sent to the device process (for tests and the log)."""
        self.inline = 0
        """Of those, payloads that did not fit the arena and travelled in the frame."""
        self.served = 0
        """Of those, inference calls, stream messages and REST requests: the idle trim's
        activity (``process_tuning.IdleTrim``; the other gRPC calls, a gateway's probes among
        them, do not count)."""

    async def request(self, kind: int, rpc: Any, data, deadline_ns: int) -> Answer:
        """Serve one request in the device process and return its answer."""
        self._next_id += 1
        rid = self._next_id
        nbytes = len(data)
        slot = self._ring.alloc(nbytes) if nbytes else None
        if slot is not None:
            self._requests.write(slot, (data,))
            payload: Any = (slot, nbytes)
        else:
            payload = bytes(data)
            if nbytes:
                self.inline += 1
        pending = _Pending(slot)
        self._pending[rid] = pending
        self.forwarded += 1
        if kind != KIND_UNARY:
            self.served += 1
        self.channel.send((REQUEST, rid, kind, rpc, deadline_ns, payload))
        try:
            await pending.done.wait()
        except BaseException:
            if pending.answer is None:
                self.channel.send((CANCEL, rid))
            raise
        answer = pending.answer
        assert answer is not None
        return answer

    async def run_reader(
        self,
        on_drain: Callable[[], None],
        on_log: Callable[[dict[str, Any]], None],
    ) -> None:
        """Read the device process's messages until it closes the channel (then return)."""
        replies = self._replies
        async for batch in self.channel.batches():
            freed: list[int] = []
            for message in batch:
                op = message[0]
                if op == DONE:
                    _, rid, status, text, payload, extra = message
                    pending = self._pending.pop(rid, None)
                    if isinstance(payload, tuple):
                        slot, nbytes = payload
                        payload = bytes(replies.view(slot, nbytes))
                        freed.append(slot)
                    if pending is None:
                        continue
                    if pending.slot is not None:
                        self._ring.free(pending.slot)
                    pending.answer = (status, text, payload, extra)
                    pending.done.set()
                elif op == LOG:
                    on_log(message[1])
                elif op == PING:
                    self.channel.send((PONG, message[1]))
                elif op == DRAIN:
                    on_drain()
            if freed:
                self.channel.send((FREE, freed))

    @property
    def in_flight(self) -> int:
        return len(self._pending)


__all__ = ["Answer", "DeviceLink"]
