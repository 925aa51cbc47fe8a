"""``RetryPolicy`` and the retry loop for shed requests.

A server at its concurrency cap answers RESOURCE_EXHAUSTED; a gateway with no reachable replica
answers UNAVAILABLE. Both are worth another attempt a little later, as long as the request's
deadline budget allows. ``call_with_retry`` is the whole policy; the clock, the sleep and the
random source are parameters so the loop is tested without waiting.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import StatusCode

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How shed requests are retried inside the deadline budget.

    ``initial_backoff`` seconds before the first retry, times ``factor`` after each, capped at
    ``max_backoff``; with ``jitter`` each wait is drawn uniformly from ``[0, backoff]`` (full
    jitter) so concurrent chunks do not retry in lock step. ``min_budget`` is the smallest
    remaining budget worth another attempt. ``retry_unavailable`` also retries UNAVAILABLE (no
    replica reachable, server restarting). ``enabled=False`` is one attempt, fail fast.
    """

    enabled: bool = True
    initial_backoff: float = 1.0
    factor: float = 2.0
    max_backoff: float = math.inf
    min_budget: float = 0.05
    jitter: bool = True
    retry_unavailable: bool = True

    def __post_init__(self) -> None:
        if not self.initial_backoff >= 0:
            raise ValueError(
                f"RetryPolicy.initial_backoff must be >= 0, got {self.initial_backoff}"
            )
        if not self.factor >= 1:
            raise ValueError(f"RetryPolicy.factor must be >= 1, got {self.factor}")
        if not self.max_backoff >= 0:
            raise ValueError(f"RetryPolicy.max_backoff must be >= 0, got {self.max_backoff}")
        if not self.min_budget >= 0:
            raise ValueError(f"RetryPolicy.min_budget must be >= 0, got {self.min_budget}")

    def is_retryable(self, exc: BaseException) -> bool:
        """RESOURCE_EXHAUSTED always, UNAVAILABLE iff ``retry_unavailable``; never a message
        over a size cap (it would be refused again), never anything else (DEADLINE_EXCEEDED,
        NOT_FOUND, INVALID_ARGUMENT, INTERNAL, a stale shm registration, non-gRPC errors)."""
        if not isinstance(exc, RpcError) or exc.retryable is False:
            return False
        if exc.status is StatusCode.RESOURCE_EXHAUSTED:
            return "larger than max" not in exc.message
        return exc.status is StatusCode.UNAVAILABLE and self.retry_unavailable


async def call_with_retry(
    attempt: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    deadline: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[object]] = anyio.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """Run ``attempt(budget)`` until it succeeds, a non-retryable error, or the budget is spent.

    Rules (``deadline`` is the total budget in seconds, measured from this call):
    1. Disabled policy or ``deadline <= 0``: exactly one attempt, with the full budget (``None``
       when ``deadline <= 0``: no limit).
    2. Each attempt gets the remaining budget ``deadline - elapsed``, so per-attempt deadlines
       shrink and the retries never push total wall time past ``deadline``.
    3. On a retryable error (``RetryPolicy.is_retryable``) the wait is ``min(backoff,
       max_backoff)``, times ``rand()`` with jitter. If ``elapsed + wait >= deadline -
       min_budget`` the error is re-raised (with a note on the attempts made); else sleep,
       ``backoff *= factor`` and go to 2.
    4. Any other error propagates at once.
    """
    if not policy.enabled or deadline <= 0:
        return await attempt(deadline if deadline > 0 else None)
    start = clock()
    backoff = policy.initial_backoff
    attempts = 0
    while True:
        budget = deadline - (clock() - start)
        attempts += 1
        try:
            return await attempt(budget)
        except RpcError as exc:
            if not policy.is_retryable(exc):
                raise
            wait = min(backoff, policy.max_backoff)
            if policy.jitter:
                wait *= rand()
            elapsed = clock() - start
            if elapsed + wait >= deadline - policy.min_budget:
                exc.add_note(
                    f"gave up after {attempts} attempt(s) in {elapsed:.3f}s: the deadline "
                    f"budget of {deadline:g}s leaves no room for another"
                )
                raise
        await sleep(wait)
        backoff *= policy.factor


__all__ = ["RetryPolicy", "call_with_retry"]
