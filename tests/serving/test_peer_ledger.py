"""``PeerLedger``'s rules on a clock the test moves: the connection rate per peer address, and
probation after abuse (a strictness that doubles per abuse, divides the rate and shrinks the
premature-reset window, and is forgotten once the probation has passed)."""

from __future__ import annotations

from kserve_trio.serving.peer_ledger import (
    MAX_PEERS,
    MAX_STRICTNESS,
    MIN_JUDGED_STREAMS,
    PeerLedger,
    judged_streams,
    peer_host,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_opens_one_seconds_worth_at_once_then_the_rate():
    clock = Clock()
    ledger = PeerLedger(10, 60, clock)
    assert [ledger.admit("10.0.0.1") for _ in range(10)] == [1] * 10
    assert ledger.admit("10.0.0.1") is None  # the bucket is empty
    assert ledger.admit("10.0.0.2") == 1  # another address has its own
    clock.now += 0.1  # one token back
    assert ledger.admit("10.0.0.1") == 1
    assert ledger.admit("10.0.0.1") is None


def test_probation_doubles_per_abuse_divides_the_rate_and_is_served_out():
    clock = Clock()
    ledger = PeerLedger(64, 60, clock)
    assert [ledger.abused("p") for _ in range(8)] == [2, 4, 8, 16, 32, 64, 64, 64]
    assert MAX_STRICTNESS == 64
    clock.now += 1.0
    assert ledger.admit("p") == 64  # 64 / 64 = one connection a second
    assert ledger.admit("p") is None
    clock.now += 59.5  # 60.5 s after the latest abuse: probation served
    assert ledger.admit("p") == 1
    assert [ledger.admit("p") for _ in range(10)] == [1] * 10


def test_probation_off_never_raises_the_strictness():
    ledger = PeerLedger(0, 0, Clock())
    assert not ledger.enabled
    assert ledger.abused("p") == 1
    assert ledger.admit("p") == 1


def test_the_judged_window_shrinks_with_the_strictness_down_to_a_floor():
    assert judged_streams(500, 1) == 500
    assert judged_streams(500, 2) == 250
    assert judged_streams(500, 64) == MIN_JUDGED_STREAMS
    assert judged_streams(4, 2) == 4  # never more than the configured window


def test_the_ledger_forgets_the_least_recently_seen_peer_beyond_its_bound():
    clock = Clock()
    ledger = PeerLedger(1, 60, clock)
    ledger.abused("first")
    for i in range(MAX_PEERS):
        ledger.admit(f"10.1.{i // 256}.{i % 256}")
    assert ledger.admit("first") == 1  # forgotten: a fresh record, off probation
    assert len(ledger._peers) == MAX_PEERS


def test_the_host_of_a_peer_address():
    assert peer_host(("127.0.0.2", 5000)) == "127.0.0.2"
    assert peer_host(("::1", 5000, 0, 0)) == "::1"
    assert peer_host(None) == ""
