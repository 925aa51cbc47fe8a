"""The request parameters the codec knows (deadlines, Triton's ``timeout``, shared memory)
and their typed accessors.

Parameter maps hold plain values (``core.protocol.wire.ParamValue``); the accessors also read a
betterproto2 ``InferParameter`` (a message built by hand), so a caller may hand either.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.codec._types import ShmRef
from kserve_trio.core.protocol.wire import Params, plain_param

TIMEOUT_NS_PARAM = "reactant_timeout_ns"
"""Request parameter (``int64_param``): the caller's REMAINING budget in nanoseconds."""

TRITON_TIMEOUT_PARAM = "timeout"
"""Triton's request parameter (``int64_param``): a timeout in microseconds."""

SHM_REGION_PARAM = "shared_memory_region"
SHM_OFFSET_PARAM = "shared_memory_offset"
SHM_BYTE_SIZE_PARAM = "shared_memory_byte_size"

INT64_MAX = 2**63 - 1


def int64_param(params: Mapping[str, Any], key: str) -> int | None:
    """The ``int64_param`` value of ``params[key]``; absent or another kind (``bool``,
    ``Uint64``, ``float``, ``str``) -> None."""
    value = params.get(key)
    if type(value) is int or value is None:
        return value
    value = plain_param(value)
    return value if type(value) is int else None


def string_param(params: Mapping[str, Any], key: str) -> str | None:
    """The ``string_param`` value of ``params[key]``; absent or another kind -> None."""
    value = params.get(key)
    if type(value) is str or value is None:
        return value
    value = plain_param(value)
    return value if type(value) is str else None


def _saturating_deadline(now_ns: int, budget_ns: int) -> int:
    return min(now_ns + budget_ns, INT64_MAX)


def combine_deadlines(*deadlines_ns: int) -> int:
    """The effective deadline: the smallest non-zero absolute deadline, 0 when all are 0."""
    live = [d for d in deadlines_ns if d > 0]
    return min(live) if live else 0


def deadline_from_parameters(params: Mapping[str, Any], now_ns: int | None = None) -> int:
    """Absolute monotonic deadline from a request's parameters (0 = none).

    Rules:
    1. ``reactant_timeout_ns`` (``int64_param``, remaining ns) -> ``now + budget``.
    2. Triton's ``timeout`` (``int64_param``, microseconds) -> ``now + timeout * 1000``.
    3. Absent, another kind of value, or ``<= 0`` -> no deadline from that source.
    4. Sums saturate at int64 max; the smaller of the non-zero results wins.
    """
    if not params:
        return 0
    budget = int64_param(params, TIMEOUT_NS_PARAM)
    micros = int64_param(params, TRITON_TIMEOUT_PARAM)
    has_budget = budget is not None and budget > 0
    has_micros = micros is not None and micros > 0
    if not (has_budget or has_micros):
        return 0
    now = time.monotonic_ns() if now_ns is None else now_ns
    a = _saturating_deadline(now, budget) if has_budget else INT64_MAX  # type: ignore[operator]
    b = _saturating_deadline(now, micros * 1000) if has_micros else INT64_MAX  # type: ignore[operator]
    return a if a < b else b


def deadline_params(budget_ns: int) -> Params:
    """Request parameters carrying a remaining budget of ``budget_ns`` (empty for <= 0)."""
    if budget_ns <= 0:
        return {}
    return {TIMEOUT_NS_PARAM: min(int(budget_ns), INT64_MAX)}


def shm_ref(what: str, params: Mapping[str, Any]) -> ShmRef | None:
    """The three shm parameters of a tensor (values of another kind count as absent)."""
    if not params:
        return None
    region = string_param(params, SHM_REGION_PARAM)
    if region is None:
        return None
    offset = int64_param(params, SHM_OFFSET_PARAM)
    offset = 0 if offset is None else offset
    byte_size = int64_param(params, SHM_BYTE_SIZE_PARAM)
    if byte_size is None:
        raise InvalidArgument(
            f"{what} names shared memory region '{region}' but has no {SHM_BYTE_SIZE_PARAM}"
        )
    if offset < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_OFFSET_PARAM} {offset}")
    if byte_size < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_BYTE_SIZE_PARAM} {byte_size}")
    return ShmRef(region, offset, byte_size)


def shm_params(ref: ShmRef) -> Params:
    """The three shm parameters naming ``ref``."""
    return {
        SHM_REGION_PARAM: ref.region,
        SHM_OFFSET_PARAM: int(ref.offset),
        SHM_BYTE_SIZE_PARAM: int(ref.byte_size),
    }


def in_shared_memory(out: Any) -> bool:
    """Whether the server wrote ``out`` (an output tensor) to shared memory (its region
    parameter is set)."""
    return bool(out.parameters) and string_param(out.parameters, SHM_REGION_PARAM) is not None
