"""``watch_liveness``: how a supervisor finds that one of its serving processes is stuck, and
``kill_when_stuck``: what it does then.

A process that is stopped (SIGSTOP) or whose event loop never comes back keeps its listening
socket: the kernel goes on handing it new connections, which time out, and since it does not
exit no keep-running loop notices. So its supervisor (the device process for its front ends,
the gateway's parent for its children) asks it for an answer that only its event loop can give
(a ping over the front end's channel, the child's ``/healthz``), with a deadline, and kills it
when it keeps not answering: SIGKILL, since a stopped process cannot drain. Its keep-running
loop then restarts it as after any other exit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kserve_trio.serving.supervisor import ChildProcess


async def watch_liveness(
    probe: Callable[[], Awaitable[bool]], interval: float, misses: int
) -> None:
    """Return once ``probe`` has missed ``misses`` times in a row (never when ``misses`` is 0).

    Rules:
    1. a probe starts every ``interval`` seconds and has until the next one to answer;
    2. a probe that returns False or is still waiting at its deadline is a miss; one that
       returns True sets the count of misses back to 0;
    3. the ``misses``-th miss in a row ends the watch (the caller kills the process).

    One late answer (the supervisor's own loop was busy past a deadline) costs one miss, not
    a kill: a kill takes ``misses`` intervals without any answer.
    """
    if misses <= 0:
        await anyio.sleep_forever()
    missed = 0
    while True:
        deadline = anyio.current_time() + interval
        answered = False
        with anyio.move_on_after(interval):
            answered = await probe()
        missed = 0 if answered else missed + 1
        if missed >= misses:
            return
        await anyio.sleep_until(deadline)


async def kill_when_stuck(
    process: ChildProcess,
    probe: Callable[[], Awaitable[bool]],
    interval: float,
    misses: int,
    *,
    stopping: anyio.Event,
    on_kill: Callable[[], None],
    log: Any,
    event: str,
    **labels: object,
) -> None:
    """``watch_liveness`` for ``process``; once it ends, unless its supervisor is already
    stopping it (that stop owns the end): ``on_kill()`` (the caller counts the kill), the
    warning ``event`` with ``labels``, the pid and the rule that caught it, and SIGKILL."""
    await watch_liveness(probe, interval, misses)
    if stopping.is_set():
        return
    on_kill()
    log.warning(event, **labels, pid=process.pid, missed_probes=misses, interval_seconds=interval)
    process.kill()


__all__ = ["kill_when_stuck", "watch_liveness"]
