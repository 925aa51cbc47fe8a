"""``keep_running``: the loop that keeps one supervised process running, for every supervisor
(the gateway's parent, a worker's device process for its front ends, the node).

What one process of it is (how it starts, what it is watched for, what "up" means) is the
caller's ``run_once``; when it is started again and when the supervisor gives up is the
caller's ``RestartPolicy``. How it is stopped is the caller's too: it sets ``stop`` and ends
the running process its own way (SIGTERM, a drain message), and the loop starts no other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from kserve_trio.serving.supervisor._policy import RestartPolicy


@dataclass(frozen=True)
class Exit:
    """How one process of a kept child ended (``run_once``'s answer)."""

    returncode: int | None
    """Its exit status (negative: the signal that ended it); None: it could not be started."""
    came_up: bool = True
    """Whether it got as far as its supervisor calls up (announced its port, said READY)."""


@dataclass(frozen=True)
class Restart:
    """What ``on_restart`` is told before each pause: the exit and what follows it."""

    exit: Exit
    uptime: float
    failures: int
    """Consecutive failures so far, this exit included (``RestartPolicy`` rule 1)."""
    pause: float
    """Seconds until the next start (cut short only by ``stop``)."""

    def log_fields(self) -> dict[str, object]:
        """What a supervisor's log record of the exit says, beside which process it was."""
        return {
            "returncode": self.exit.returncode,
            "uptime_seconds": round(self.uptime, 3),
            "restart_in_seconds": self.pause,
        }


@dataclass(frozen=True)
class GaveUp:
    """``keep_running``'s answer when the policy gave up on the process."""

    exit: Exit
    failures: int
    never_up: bool
    """True: no process of it ever came up (``RestartPolicy.must_come_up_first``); False: it
    failed more than ``max_failures`` times in a row."""


class FailedToStart(RuntimeError):
    """What a supervisor raises for a ``GaveUp`` with ``never_up``: the process exited before
    it ever came up, so the supervisor's own start fails with its exit status."""

    def __init__(self, what: str, returncode: int | None) -> None:
        super().__init__(f"{what} exited with status {returncode} at start-up")
        self.returncode = returncode


def _nothing(restart: Restart) -> None:
    del restart


async def keep_running(
    run_once: Callable[[], Awaitable[Exit]],
    policy: RestartPolicy,
    stop: anyio.Event,
    on_restart: Callable[[Restart], None] = _nothing,
) -> GaveUp | None:
    """Run ``run_once`` again and again until ``stop`` is set or ``policy`` gives up.

    Rules:
    1. ``run_once`` starts one process and returns once that process has exited;
    2. an exit once ``stop`` is set ends the loop (None); so does a ``stop`` set during a pause;
    3. otherwise ``policy`` counts the failure and answers: give up (``GaveUp``), or pause
       ``policy.pause(failures)`` seconds after telling ``on_restart``, then rule 1 again.

    Cancelling it cancels ``run_once``, which must leave no process behind.
    """
    failures = 0
    ever_up = False
    while not stop.is_set():
        started = anyio.current_time()
        ended = await run_once()
        if stop.is_set():
            return None
        uptime = anyio.current_time() - started
        ever_up = ever_up or ended.came_up
        failures = policy.failures_after(failures, uptime)
        if policy.must_come_up_first and not ever_up:
            return GaveUp(ended, failures, never_up=True)
        if policy.gives_up(failures):
            return GaveUp(ended, failures, never_up=False)
        pause = policy.pause(failures)
        on_restart(Restart(ended, uptime, failures, pause))
        with anyio.move_on_after(pause):
            await stop.wait()
    return None


__all__ = ["Exit", "FailedToStart", "GaveUp", "Restart", "keep_running"]
