"""The one patch we keep on h2's dependencies still applies to the installed hyperframe: a DATA
frame's repr (which h2 builds for every frame it receives) is O(1) in the payload."""

from __future__ import annotations

import binascii

import hyperframe.frame as hf
import pytest

import kserve_trio.http2._h2  # noqa: F401  (importing the h2 engine applies the patch)
from kserve_trio.http2._h2_repr import patch_frame_repr, short_hex


def test_a_large_data_frames_repr_is_short_and_shows_its_first_bytes():
    frame = hf.DataFrame(1, data=b"\x01" * (600 << 10))
    text = repr(frame)
    assert "data=<hex:01010101010101010101...>" in text
    assert len(text) < 200


def test_the_repr_never_hexlifies_the_whole_payload(monkeypatch: pytest.MonkeyPatch):
    seen: list[int] = []
    real = binascii.hexlify

    def counting(data, *args):
        seen.append(len(data))
        return real(data, *args)

    monkeypatch.setattr(binascii, "hexlify", counting)
    payload = memoryview(bytes(600 << 10))  # as h2 hands hyperframe a received frame
    repr(hf.DataFrame(1, data=payload))  # pyright: ignore[reportArgumentType]
    assert seen and max(seen) <= 10


def test_short_and_empty_payloads_are_shown_whole_or_as_none():
    assert short_hex(b"\xab\xcd") == "<hex:abcd>"
    assert short_hex(b"") == "None"
    assert short_hex(None) == "None"
    assert repr(hf.DataFrame(3, data=b"")).endswith("data=None")


def test_patching_twice_changes_nothing():
    patch_frame_repr()
    patch_frame_repr()
    assert "<hex:0000000000" in repr(hf.DataFrame(1, data=bytes(100)))
