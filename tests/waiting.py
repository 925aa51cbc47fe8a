"""Waiting for a condition in a test: a deadline and a poll, never a sleep that guesses how long
something takes (one helper for every module that waits on another process or thread)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")

POLL_SECONDS = 0.01


def wait_until(condition: Callable[[], T], timeout: float = 10.0, what: str = "") -> T:
    """Poll ``condition`` until it holds and return what it returned then; AssertionError
    naming ``what`` past ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or 'the condition'}")
        time.sleep(POLL_SECONDS)
    return value


def succeeds_within(call: Callable[[], object], timeout: float, what: str = "") -> float:
    """Call ``call`` until it raises nothing; the seconds that took. Past ``timeout`` the
    AssertionError names ``what`` with the last failure as its cause (a server that may refuse a
    new connection for a moment, e.g. while its last clients are still being closed)."""
    start = time.monotonic()
    failures: list[Exception] = []

    def succeeded() -> bool:
        try:
            call()
        except Exception as exc:
            failures.append(exc)
            return False
        return True

    try:
        wait_until(succeeded, timeout, what)
    except AssertionError as exc:
        raise exc from (failures[-1] if failures else None)
    return time.monotonic() - start


async def until(condition: Callable[[], T], timeout: float = 10.0, what: str = "") -> T:
    """``wait_until`` for a test on an event loop: polls between turns of the loop, so the
    tasks that make ``condition`` hold run meanwhile."""
    deadline = anyio.current_time() + timeout
    while not (value := condition()):
        if anyio.current_time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or 'the condition'}")
        await anyio.sleep(POLL_SECONDS)
    return value


__all__ = ["succeeds_within", "until", "wait_until"]
