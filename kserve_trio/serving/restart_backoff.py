"""How long a supervisor waits before it starts a crashed child process again: the gateway's
processes and a worker's front ends follow the same rule.

The ``k``-th consecutive failure waits ``min(0.25 * 2 ** (k - 1), 10)`` seconds; ``k`` counts
from 1 again once a child stayed up ``STABLE_SECONDS``. So a child that crashes at once is not
restarted in a tight loop, and one that ran for a while and then crashed comes back quickly.
"""

from __future__ import annotations

from dataclasses import dataclass

STABLE_SECONDS = 30.0
BACKOFF_FIRST_SECONDS = 0.25
BACKOFF_CAP_SECONDS = 10.0


def backoff_seconds(failures: int) -> float:
    """The pause after the ``failures``-th consecutive failure."""
    return min(BACKOFF_FIRST_SECONDS * 2 ** max(failures - 1, 0), BACKOFF_CAP_SECONDS)


@dataclass
class RestartBackoff:
    """One child's consecutive failures."""

    failures: int = 0

    def after_exit(self, uptime: float) -> float:
        """The pause before the next start of a child that ran ``uptime`` seconds."""
        self.failures = 1 if uptime >= STABLE_SECONDS else self.failures + 1
        return backoff_seconds(self.failures)


__all__ = [
    "BACKOFF_CAP_SECONDS",
    "BACKOFF_FIRST_SECONDS",
    "STABLE_SECONDS",
    "RestartBackoff",
    "backoff_seconds",
]
