"""The node's restart policy: when a dead child is started again, and when the node gives up
on it.

A child that keeps dying is restarted with exponential backoff (``min(2 ** (k - 1), 30)``
seconds for the ``k``-th failure in a row: 1, 2, 4, 8, 16, 30, 30 ...); one that ran a minute
before dying is treated as a fresh failure. ``KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS`` bounds the
consecutive failures (0, the default, restarts forever); past it the node stops, exit 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from kserve_trio.core.errors import ConfigError
from kserve_trio.serving.supervisor import RestartPolicy

MAX_RESTARTS_ENV = "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS"


def restart_policy(max_restarts: int) -> RestartPolicy:
    """The node's policy for each of its children (module docstring)."""
    return RestartPolicy(
        first_pause=1.0, max_pause=30.0, stable_after=60.0, max_failures=max_restarts
    )


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


__all__ = ["MAX_RESTARTS_ENV", "max_restarts", "restart_policy"]
