"""``RestartPolicy``: when a supervisor starts a process again after it exited, and when it
gives up on it (pure; ``keep_running`` applies it).

Each supervisor states its own numbers where it keeps its processes running, so the rule is
written once and what differs between the callers is only data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """The back-off before each restart and the limits on restarting.

    Rules (``failures`` counts the consecutive failures of one kept process):

    1. an exit after ``stable_after`` seconds of uptime or more counts as the first failure
       (a process that ran a while and then crashed comes back quickly); any other exit adds
       one to the count;
    2. the pause before the next start is ``min(first_pause * 2 ** (failures - 1),
       max_pause)`` (a process that crashes at once is not restarted in a tight loop);
    3. past ``max_failures`` consecutive failures (when it is above 0) the supervisor gives up;
    4. with ``must_come_up_first``, a process that exits before any process of it came up
       (its supervisor's own notion: announced its port, said READY) is given up at once: a
       configuration or bind error shows as that error, not as a restart loop.
    """

    first_pause: float
    """Seconds before the restart that follows the first failure."""
    max_pause: float
    """The longest pause, however many failures came in a row."""
    stable_after: float
    """Uptime after which an exit starts the count of failures again."""
    max_failures: int = 0
    """Consecutive failures after which the supervisor gives up (0: never)."""
    must_come_up_first: bool = False
    """Whether an exit before the first time the process came up gives up (rule 4)."""

    def failures_after(self, failures: int, uptime: float) -> int:
        """Rule 1: the count once a process that ran ``uptime`` seconds has exited."""
        return 1 if uptime >= self.stable_after else failures + 1

    def pause(self, failures: int) -> float:
        """Rule 2: the pause before the start that follows the ``failures``-th failure."""
        return min(self.first_pause * 2 ** max(failures - 1, 0), self.max_pause)

    def gives_up(self, failures: int) -> bool:
        """Rule 3."""
        return self.max_failures > 0 and failures > self.max_failures


__all__ = ["RestartPolicy"]
