"""The node's restart policy (backoff and crash-loop budget) and its environment variable."""

from __future__ import annotations

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._restart import max_restarts, restart_policy


def test_backoff_doubles_from_one_second_up_to_thirty():
    policy = restart_policy(0)
    assert [policy.pause(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_minute_up_counts_as_a_fresh_failure():
    policy = restart_policy(2)
    assert policy.failures_after(2, 60.0) == 1
    assert policy.failures_after(1, 59.9) == 2


def test_the_budget_gives_up_past_max_consecutive_failures_and_zero_means_forever():
    assert [restart_policy(2).gives_up(n) for n in (1, 2, 3)] == [False, False, True]
    assert not any(restart_policy(0).gives_up(n) for n in range(1, 100))


def test_max_restarts_from_the_environment():
    assert max_restarts({}) == 0
    assert max_restarts({"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "5"}) == 5
    for bad in ("-1", "x"):
        with pytest.raises(ConfigError, match="KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS"):
            max_restarts({"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": bad})
