"""The ``h2`` engine's frame guard on its own: the frame-header scan over any split of the bytes
into reads (the client preface, headers and payloads cut anywhere), and each rule's arithmetic
on a clock the test moves."""

from __future__ import annotations

import pytest

from kserve_trio.http2 import EngineSettings
from kserve_trio.http2._h2_guard import (
    FRAME_TOO_LARGE,
    GLITCH_FLOOD,
    HEADER_BLOCK_TOO_LARGE,
    RESET_FLOOD,
    TOO_MANY_SETTINGS,
    FrameGuard,
    Violation,
)
from tests.edge.h2_attacker import (
    PREFACE,
    continuation,
    data,
    ping,
    raw_frame,
    rst,
    settings,
    window_update,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def guard(clock: Clock | None = None, **fields: object) -> FrameGuard:
    return FrameGuard(EngineSettings(**fields), clock or Clock())  # type: ignore[arg-type]


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
        g = guard(max_header_list=cap)
        assert scan_in_pieces(g, block, [cut]) is HEADER_BLOCK_TOO_LARGE, cut
    for cut in range(1, over_at - 9, 37):  # three reads: the verdict waits for the header
        g = guard(max_header_list=cap)
        assert g.scan(block[:cut]) is None
        assert g.scan(block[cut : over_at - 1]) is None
        assert g.scan(block[over_at - 1 :]) is HEADER_BLOCK_TOO_LARGE


def test_a_block_within_the_cap_and_blocks_one_after_another_pass():
    g = guard(max_header_list=1000)
    one = headers_frame(1, b"h" * 600, end_headers=False) + continuation(
        1, b"c" * 400, end_headers=True
    )
    two = headers_frame(3, b"h" * 1000, end_headers=True)  # a new block counts from zero
    assert scan_in_pieces(g, PREFACE + settings() + one + two, [5, 30, 700]) is None


def test_a_fragment_announced_too_large_is_refused_before_its_payload_arrives():
    g = guard(max_header_list=1 << 16, max_frame=1 << 20)
    frame = continuation(1, b"c" * (1 << 18))
    assert g.scan(PREFACE + settings() + headers_frame(1, b"h" * 100, end_headers=False)) is None
    assert g.scan(frame[:9]) is HEADER_BLOCK_TOO_LARGE


def test_a_header_frame_over_the_frame_size_is_a_frame_size_error_first():
    g = guard(max_header_list=1 << 20, max_frame=1 << 14)
    big = headers_frame(1, b"h" * 20000, end_headers=True)
    assert g.scan(PREFACE + settings() + big[:9]) is FRAME_TOO_LARGE


def test_more_continuations_than_allowed_end_the_block():
    g = guard(max_continuations=3)
    frames = headers_frame(1, b"h", end_headers=False) + continuation(1, b"c") * 4
    assert g.scan(PREFACE + settings() + frames) is HEADER_BLOCK_TOO_LARGE


def test_a_settings_frame_of_too_many_entries_is_refused():
    g = guard(max_settings_entries=4)
    assert g.scan(PREFACE + raw_frame(0x4, 0, 0, b"\x00\x03\x00\x00\x00\x64" * 4)) is None
    assert g.scan(raw_frame(0x4, 0, 0, b"\x00\x03\x00\x00\x00\x64" * 5)) is TOO_MANY_SETTINGS


def test_the_glitch_bucket_holds_its_burst_and_refills_at_the_rate():
    clock = Clock()
    g = guard(clock, glitch_rate=(100, 100))
    assert g.scan(PREFACE + settings() * 99) is None  # 100 with this one
    assert g.scan(window_update(0, 1)) is None
    assert g.scan(window_update(0, 1)) is GLITCH_FLOOD
    g = guard(clock, glitch_rate=(100, 100))
    g.scan(PREFACE + settings() * 100)
    clock.now += 0.5  # 50 tokens back
    assert g.scan(raw_frame(0xFA, 0, 0) * 50) is None
    assert g.scan(data(1, b"")) is GLITCH_FLOOD  # empty DATA counts
    g = guard(clock, glitch_rate=(100, 100))
    stream = (
        PREFACE
        + settings()
        + b"".join(data(1, b"x") + data(1, b"", end_stream=True) for _ in range(500))
        + ping() * 10
    )
    assert g.scan(stream) is None  # DATA with a payload or END_STREAM does not


def test_the_reset_bucket_is_its_own():
    clock = Clock()
    g = guard(clock, reset_rate=(10, 10), glitch_rate=(1000, 1000))
    assert g.scan(PREFACE + settings() + rst(1) * 10) is None
    assert g.scan(rst(3)) is RESET_FLOOD
    off = guard(clock, reset_rate=(0, 0))
    assert off.scan(PREFACE + settings() + rst(1) * 10000) is None


@pytest.mark.parametrize("cut", [1, 5, 9, 20, 33])
def test_a_frame_header_cut_by_a_read_is_judged_once_whole(cut: int):
    g = guard(max_header_list=100)
    stream = PREFACE + settings() + headers_frame(1, b"h" * 200, end_headers=True)
    head_at = len(PREFACE + settings())
    assert scan_in_pieces(g, stream, [head_at + min(cut, 8)]) is HEADER_BLOCK_TOO_LARGE
