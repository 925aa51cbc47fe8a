"""``FrameGuard`` and ``ResetJudge`` on their own: the frame-header scan over any split of the
bytes into reads (the client preface, headers and payloads cut anywhere), and each rule's
arithmetic on a clock the test moves."""

from __future__ import annotations

import pytest
from kserve_trio.serving.grpc._frame_guard import (
    CONTROL_FRAME_FLOOD,
    HEADER_BLOCK_TOO_LARGE,
    TOO_MANY_PINGS,
    FrameGuard,
    ResetJudge,
    Violation,
)

from kserve_trio.core.config import EdgeLimits
from tests.edge.h2_attacker import (
    PREFACE,
    continuation,
    data,
    ping,
    raw_frame,
    settings,
    window_update,
)


class Sent:
    payload_sent = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock | None = None, **limits: float) -> FrameGuard:
    return FrameGuard(EdgeLimits(**limits), Sent(), clock or Clock())  # type: ignore[arg-type]


def headers_frame(sid: int, fragment: bytes, *, end_headers: bool) -> bytes:
    return raw_frame(0x1, 0x4 if end_headers else 0, sid, fragment)


def scan_in_pieces(g: FrameGuard, stream: bytes, cuts: list[int]) -> Violation | None:
    """``stream`` fed to ``g`` cut at ``cuts``; the first verdict."""
    pos = 0
    for cut in [*cuts, len(stream)]:
        verdict = g.scan(stream[pos:cut])
        pos = cut
        if verdict is not None:
            return verdict
    return None


@pytest.mark.timeout(30)
def test_a_header_block_over_the_cap_is_found_wherever_the_reads_cut_the_bytes():
    cap = 1000
    block = (
        PREFACE
        + settings()
        + data(1, b"x" * 700)  # a payload the scan skips without reading
        + headers_frame(3, b"h" * 400, end_headers=False)
        + continuation(3, b"c" * 400)
        + continuation(3, b"c" * 400)  # 1200 fragment bytes: over
    )
    over_at = len(block) - 400  # the last CONTINUATION's header is where it is known
    for cut in range(1, len(block)):
        g = guard(max_header_list_bytes=cap)
        assert scan_in_pieces(g, block, [cut]) is HEADER_BLOCK_TOO_LARGE, cut
    for cut in range(1, over_at - 9, 37):  # three reads: the verdict waits for the header
        g = guard(max_header_list_bytes=cap)
        assert g.scan(block[:cut]) is None
        assert g.scan(block[cut : over_at - 1]) is None
        assert g.scan(block[over_at - 1 :]) is HEADER_BLOCK_TOO_LARGE


@pytest.mark.timeout(30)
def test_a_block_within_the_cap_and_blocks_one_after_another_pass():
    g = guard(max_header_list_bytes=1000)
    one = headers_frame(1, b"h" * 600, end_headers=False) + continuation(
        1, b"c" * 400, end_headers=True
    )
    two = headers_frame(3, b"h" * 1000, end_headers=True)  # a new block counts from zero
    assert scan_in_pieces(g, PREFACE + settings() + one + two, [5, 30, 700]) is None


@pytest.mark.timeout(30)
def test_a_fragment_announced_too_large_is_refused_before_its_payload_arrives():
    g = guard(max_header_list_bytes=1 << 16)
    frame = continuation(1, b"c" * (1 << 20))
    assert g.scan(PREFACE + settings() + headers_frame(1, b"h" * 100, end_headers=False)) is None
    assert g.scan(frame[:9]) is HEADER_BLOCK_TOO_LARGE


@pytest.mark.timeout(30)
def test_handshaken_only_once_the_preface_and_a_whole_first_settings_frame_are_in():
    g = guard()
    stream = PREFACE + raw_frame(0x4, 0, 0, b"\x00\x03\x00\x00\x00\x64")
    for byte in range(len(stream) - 1):
        g.scan(stream[byte : byte + 1])
        assert not g.handshaken
    g.scan(stream[-1:])
    assert g.handshaken
    other = guard()
    other.scan(PREFACE + window_update(0, 1))  # not SETTINGS first: no handshake
    assert not other.handshaken


@pytest.mark.timeout(30)
def test_the_control_frame_bucket_holds_one_seconds_worth_and_refills_at_the_rate():
    clock = Clock()
    g = guard(clock, max_control_frames_per_second=100)
    assert g.scan(PREFACE + settings() * 99) is None  # 100 with this one
    assert g.scan(window_update(0, 1)) is None
    assert g.scan(window_update(0, 1)) is CONTROL_FRAME_FLOOD
    clock.now += 0.5
    g = guard(clock, max_control_frames_per_second=100)
    g.scan(PREFACE + settings() * 100)
    clock.now += 0.5  # 50 tokens back
    assert g.scan(raw_frame(0xFA, 0, 0) * 50) is None
    assert g.scan(data(1, b"")) is CONTROL_FRAME_FLOOD  # empty DATA counts
    g = guard(clock, max_control_frames_per_second=100)
    stream = (
        PREFACE
        + settings()
        + b"".join(data(1, b"x") + data(1, b"", end_stream=True) for _ in range(500))
    )
    assert g.scan(stream) is None  # DATA with a payload or END_STREAM does not


@pytest.mark.timeout(30)
def test_pings_closer_than_the_interval_without_data_are_strikes_and_data_resets_them():
    clock = Clock()
    sent = Sent()
    g = FrameGuard(
        EdgeLimits(
            min_ping_interval_seconds=1.0, max_ping_strikes=2, max_control_frames_per_second=0
        ),
        sent,
        clock,
    )
    assert g.scan(PREFACE + settings() + ping() * 3) is None  # no strike, then two
    assert g.scan(raw_frame(0x6, 0x1, 0, b"12345678") * 10) is None  # ACKs are never strikes
    assert g.scan(ping()) is TOO_MANY_PINGS
    g = FrameGuard(EdgeLimits(min_ping_interval_seconds=1.0, max_ping_strikes=2), sent, clock)
    g.scan(PREFACE + settings())
    for _ in range(20):  # a keepalive within the rule
        clock.now += 1.0
        assert g.scan(ping()) is None
    for _ in range(20):  # pings with data in between, received or sent
        assert g.scan(ping() + data(1, b"x") + ping()) is None
        sent.payload_sent = True
        assert g.scan(ping()) is None
    assert not sent.payload_sent


@pytest.mark.timeout(30)
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
