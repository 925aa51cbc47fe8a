"""Restart backoff and the crash-loop budget."""

from __future__ import annotations

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._restart import RestartBudget, backoff_seconds, max_restarts


def test_backoff_doubles_from_one_second_up_to_thirty():
    assert [backoff_seconds(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_budget_gives_up_after_max_consecutive_failures():
    budget = RestartBudget(max_restarts=2)
    assert budget.on_exit(0.5) == 1
    assert budget.on_exit(0.5) == 2
    assert budget.on_exit(0.5) is None
    assert budget.give_up_message("worker0") == (
        "worker0 failed 3 consecutive times (max 2); shutting the node down"
    )


def test_a_long_uptime_resets_the_count():
    budget = RestartBudget(max_restarts=2)
    assert budget.on_exit(1) == 1
    assert budget.on_exit(1) == 2
    assert budget.on_exit(60.0) == 1  # ran a minute: a fresh failure
    assert budget.on_exit(59.9) == 2
    assert budget.on_exit(0) is None


def test_zero_means_restart_forever():
    budget = RestartBudget(max_restarts=0)
    delays = [budget.on_exit(0) for _ in range(50)]
    assert None not in delays
    assert delays[-1] == 30


def test_max_restarts_from_the_environment():
    assert max_restarts({}) == 0
    assert max_restarts({"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "5"}) == 5
    for bad in ("-1", "x"):
        with pytest.raises(ConfigError, match="KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS"):
            max_restarts({"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": bad})
