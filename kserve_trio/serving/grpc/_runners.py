"""The call tasks of one connection: each call's handler run in a task, tasks reused.

A task spawn costs several times a hand-over to a task that waits (docs/benchmarks/history.md,
"Decisions measured on the way"), so a task that has served a call waits for the next call of its
connection instead of ending. The rules of a call's run:

- *No stale cancellation*: a task serves its calls in one cancel scope until a call is
  cancelled (opening a scope per call costs more than the rest of the hand-over), and never
  serves a call in a scope that has been cancelled: when a cancellation lands as one call ends
  (a deadline that passes while its reply is being queued) and has not been delivered yet,
  the next call gets a fresh scope. (Checking only for a delivered cancellation was not
  enough on asyncio, where delivery can wait a loop turn: the next call's first checkpoint
  raised the stale cancellation, and the call ended OK with no reply.)
- *Late deadline*: a call whose deadline passed while it waited for its task is not started.
- *Errors*: an exception from the handler ends the call with ``status_of``'s status, unless
  the call has already ended (answered, expired or reset).
- *No empty OK*: a unary call whose handler returns without a reply is a bug, answered INTERNAL;
  a call whose handler was cancelled without its deadline or a reset (nothing but the server
  does that) is answered UNAVAILABLE. Neither ever ends OK with no message.
- *Idle tasks*: at most ``MAX_IDLE_RUNNERS`` wait for work; more end as they go idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.abc

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.grpc._call import Call, CallEvent, CallState
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.rpc_codec import status_of

log = get_logger("kserve_trio.serving.grpc")

MAX_IDLE_RUNNERS = 64
"""Idle call tasks a connection keeps for its next calls."""


class _Mailbox:
    """One reusable task's next call, and its wake-up."""

    __slots__ = ("call", "method", "wake")

    def __init__(self, call: Call, method: Method) -> None:
        self.call: Call | None = call
        self.method: Method | None = method
        self.wake: anyio.Event | None = None


class CallRunners:
    """The call tasks of one connection, inside its task group (module docstring)."""

    def __init__(self, tg: anyio.abc.TaskGroup, ended: Callable[[Call], None]) -> None:
        """``ended(call)``: the connection's bookkeeping once a call is over."""
        self._tg = tg
        self._ended = ended
        self._idle: list[_Mailbox] = []

    def run(self, call: Call, method: Method) -> None:
        """Serve ``call`` in an idle task, or in a new one."""
        idle = self._idle
        if idle:
            box = idle.pop()
            box.call = call
            box.method = method
            wake = box.wake
            if wake is not None:
                box.wake = None
                wake.set()
            return
        self._tg.start_soon(self._task, _Mailbox(call, method))

    async def _task(self, box: _Mailbox) -> None:
        idle = self._idle
        while True:
            serving: tuple[Call, Method] | None = None
            with anyio.CancelScope() as scope:
                while True:
                    call, method = box.call, box.method
                    if call is None or method is None:
                        if len(idle) >= MAX_IDLE_RUNNERS:
                            return
                        idle.append(box)
                        wake = box.wake = anyio.Event()
                        try:
                            await wake.wait()
                        except BaseException:
                            # A cancellation meant for the last call (it landed as that call
                            # ended) is caught by the scope; the connection's end is not. A
                            # call handed over meanwhile stays in the mailbox.
                            if box in idle:
                                idle.remove(box)
                            raise
                        continue
                    if scope.cancel_called:
                        break  # *no stale cancellation*: a fresh scope for this call
                    box.call = box.method = None
                    serving = (call, method)
                    await self._serve(call, method, scope)
                    serving = None
            if serving is not None:  # its handler was cancelled (its deadline, a reset)
                call, method = serving
                call.scope = None
                self._finish(call, method, cancelled=True)

    async def _serve(self, call: Call, method: Method, scope: anyio.CancelScope) -> None:
        """One call, start to end (module docstring); a cancellation of its handler leaves
        through ``scope`` (the task's) and is finished there."""
        if self._starts(call):
            call.scope = scope
            try:
                await method.run(call)
            except Exception as exc:
                if call.state is CallState.RUNNING:
                    status, message = status_of(exc, rpc=call.rpc)
                    call.finish(status, message)
            call.scope = None
        self._finish(call, method, cancelled=False)

    @staticmethod
    def _starts(call: Call) -> bool:
        """*Late deadline*, and a call reset while it waited. Both clocks are asked: the
        connection's (what its timers run on) and a fresh monotonic reading, since an event
        loop may read its clock once per turn (uvloop), and a deadline of nanoseconds would
        then look unexpired for the whole turn it arrived in."""
        if call.deadline is not None and (
            anyio.current_time() >= call.deadline or time.monotonic_ns() >= call.deadline_ns
        ):
            call.expire()
        return call.move(CallEvent.START)

    def _finish(self, call: Call, method: Method, cancelled: bool) -> None:
        state = call.state
        if state is CallState.EXPIRED:
            call.finish(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        elif state is CallState.RUNNING:
            if cancelled:
                log.warning("call_cancelled_by_server", rpc=call.rpc)
                call.finish(StatusCode.UNAVAILABLE, "the call was cancelled by the server")
            elif method.unary:
                log.error("call_ended_without_reply", rpc=call.rpc)
                call.finish(StatusCode.INTERNAL, f"{call.rpc}: the server sent no reply message")
            else:
                call.finish(StatusCode.OK)
        self._ended(call)


__all__ = ["MAX_IDLE_RUNNERS", "CallRunners"]
