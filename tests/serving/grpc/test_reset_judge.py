"""``ResetJudge``: Envoy's premature-reset rule over a connection's recent calls."""

from __future__ import annotations

from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.serving.grpc._reset_judge import ResetJudge


def test_the_reset_judge_trips_on_more_than_half_of_the_recent_calls():
    judge = ResetJudge(EdgeLimits(premature_reset_min_streams=10))
    assert not any(judge.record(i % 2 == 0) for i in range(100))  # exactly half: never
    assert not judge.record(True)  # it replaces a premature one: still 5 of the last 10
    assert judge.record(True)  # 6 of the last 10
    fresh = ResetJudge(EdgeLimits(premature_reset_min_streams=10))
    assert not any(fresh.record(True) for _ in range(9))  # fewer than the minimum: never
    assert fresh.record(True)
    off = ResetJudge(EdgeLimits(premature_reset_min_streams=0))
    assert not any(off.record(True) for _ in range(100))
