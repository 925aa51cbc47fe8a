"""Waiting for a condition in a test: a deadline and a poll, never a sleep that guesses how long
something takes (one helper for every module that waits on another process or thread)."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_SECONDS = 0.01


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or 'the condition'}")
        time.sleep(POLL_SECONDS)


__all__ = ["wait_until"]
