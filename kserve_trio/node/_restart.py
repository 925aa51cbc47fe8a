"""When a dead child is started again, and when the node gives up on it (pure).

A child that keeps dying is restarted with exponential backoff; one that ran a while before
dying is treated as a fresh failure. ``KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS`` bounds the
consecutive failures (0, the default, restarts forever).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kserve_trio.core.errors import ConfigError

MAX_RESTARTS_ENV = "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS"
BACKOFF_CAP_SECONDS = 30.0
RESET_AFTER_SECONDS = 60.0


def backoff_seconds(restarts: int) -> float:
    """``min(2 ** (restarts - 1), 30)``: 1, 2, 4, 8, 16, 30, 30 ... seconds."""
    return float(min(2 ** max(restarts - 1, 0), BACKOFF_CAP_SECONDS))


def max_restarts(env: Mapping[str, str]) -> int:
    """``KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS`` (an integer >= 0; default 0 = forever)."""
    text = env.get(MAX_RESTARTS_ENV, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{MAX_RESTARTS_ENV}={text!r} must be an integer >= 0") from None
    if value < 0:
        raise ConfigError(f"{MAX_RESTARTS_ENV}={text!r} must be an integer >= 0")
    return value


@dataclass
class RestartBudget:
    """One child's consecutive-failure counter.

    ``on_exit(uptime)`` rules:
    1. an exit after ``reset_after`` seconds of uptime starts the count again;
    2. the failure is counted (a child that could not even be started counts too);
    3. past ``max_restarts`` consecutive failures (when it is > 0) the answer is ``None``:
       give up;
    4. otherwise the answer is the backoff before the next start, ``backoff_seconds(count)``.
    """

    max_restarts: int = 0
    reset_after: float = RESET_AFTER_SECONDS
    restarts: int = 0

    def on_exit(self, uptime: float) -> float | None:
        if uptime >= self.reset_after:
            self.restarts = 0
        self.restarts += 1
        if self.max_restarts > 0 and self.restarts > self.max_restarts:
            return None
        return backoff_seconds(self.restarts)

    def give_up_message(self, name: str) -> str:
        return (
            f"{name} failed {self.restarts} consecutive times (max {self.max_restarts}); "
            "shutting the node down"
        )


__all__ = [
    "BACKOFF_CAP_SECONDS",
    "MAX_RESTARTS_ENV",
    "RESET_AFTER_SECONDS",
    "RestartBudget",
    "backoff_seconds",
    "max_restarts",
]
