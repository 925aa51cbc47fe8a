"""The upstream (Julia server) environment names: ``REACTANT_*`` variables read as the
``KSERVE_TRIO_*`` variables they became, so a deployment moving over keeps working while it
renames them, and is told which name to use.

This module is the one owner of the table. Every reader of the environment (the worker and
gateway configurations, the node supervisor, the client's message caps) passes its mapping
through ``with_upstream_aliases`` first, so an alias is honoured wherever the new name is.

Rules (``resolve_upstream_env``):

1. A variable has a new name when it starts with ``REACTANT_GATEWAY_`` or is one of
   ``ALIASED``: ``KSERVE_TRIO_`` followed by the rest of its name.
2. Only the old name set: its value is read under the new name (an ``alias`` use).
3. Both names set: the new name wins and the old value is ignored (an ``ignored`` use).
4. The old names are dropped from the result, so nothing downstream (a child process of the
   node included) sees a setting twice; every other variable passes through unchanged.
5. A variable of ``UNSUPPORTED`` has no counterpart: it is dropped too, and its use says what to
   do instead (an ``unsupported`` use). Any other ``REACTANT_*`` name is not ours and passes.

``with_upstream_aliases`` applies the rules and logs each use once per process (warning
``upstream_env_alias``, ``upstream_env_ignored`` or ``upstream_env_unsupported``, naming the
variable to set instead): several readers resolve the same environment, one warning is enough.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kserve_trio.core.logging import get_logger

UPSTREAM_PREFIX = "REACTANT_"
NEW_PREFIX = "KSERVE_TRIO_"
GATEWAY_PREFIX = UPSTREAM_PREFIX + "GATEWAY_"
"""Every upstream gateway variable (``REACTANT_GATEWAY_WORKERS`` included) is an alias; one the
gateway does not know then fails as its new name would (a typo must not be inert)."""

ALIASED: frozenset[str] = frozenset(
    UPSTREAM_PREFIX + rest
    for rest in (
        "CLIENT_GRPC_MAX_SEND_MSG_BYTES",
        "CLIENT_GRPC_MAX_RECV_MSG_BYTES",
        "NODE_FILE",
        "ROLE",
        "GPUS",
        "CPU_WORKERS",
        "WORKER_NAME",
        "WORKER_THREADS",
        "SUPERVISOR_MAX_RESTARTS",
        "FANOUT_BYTES",
        "FANOUT_SLOTS",
        "META_CONCURRENCY",
    )
)
"""The upstream variables outside ``REACTANT_GATEWAY_*`` that have a ``KSERVE_TRIO_`` name.
(``KSERVE_TRIO_META_CONCURRENCY`` is refused by the worker's configuration with its reason,
so the alias carries the old name to that refusal instead of dropping it silently.)"""

UNSUPPORTED: Mapping[str, str] = {
    UPSTREAM_PREFIX + "GPU_RECLAIM_TIMEOUT_SECONDS": (
        "nothing waits for GPU memory at start-up: a worker that cannot get its device memory "
        "exits and the node restarts it with backoff (KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS "
        "bounds the retries)"
    ),
    UPSTREAM_PREFIX + "GPU_RECLAIM_MAX_USED_PERCENT": (
        "nothing waits for GPU memory at start-up; size the worker's share with "
        "INFERENCE_SERVER_RUNTIME_MEM_FRACTION"
    ),
}
"""Upstream variables with no counterpart -> what to do instead."""

UseKind = Literal["alias", "ignored", "unsupported"]


@dataclass(frozen=True)
class UpstreamUse:
    """One upstream variable found in an environment and what became of it."""

    old: str
    new: str
    """The variable to set instead ("" for an unsupported one)."""
    kind: UseKind
    advice: str = ""


def new_name(var: str) -> str | None:
    """The ``KSERVE_TRIO_*`` name an upstream variable is read as, or None when it has none."""
    if var.startswith(GATEWAY_PREFIX) or var in ALIASED:
        return NEW_PREFIX + var[len(UPSTREAM_PREFIX) :]
    return None


def resolve_upstream_env(env: Mapping[str, str]) -> tuple[dict[str, str], list[UpstreamUse]]:
    """``env`` with the module's rules applied, and the uses found (sorted by old name)."""
    out: dict[str, str] = {}
    uses: list[UpstreamUse] = []
    for var, value in env.items():
        if not var.startswith(UPSTREAM_PREFIX):
            out[var] = value
            continue
        new = new_name(var)
        if new is not None:
            uses.append(UpstreamUse(var, new, "ignored" if new in env else "alias"))
            if new not in env:
                out[new] = value
        elif var in UNSUPPORTED:
            uses.append(UpstreamUse(var, "", "unsupported", UNSUPPORTED[var]))
        else:
            out[var] = value
    uses.sort(key=lambda u: u.old)
    return out, uses


_log = get_logger("kserve_trio.core.process.upstream_env")
_announced: set[UpstreamUse] = set()
_announced_lock = threading.Lock()


def with_upstream_aliases(env: Mapping[str, str]) -> dict[str, str]:
    """``resolve_upstream_env``'s environment, each use logged once per process."""
    out, uses = resolve_upstream_env(env)
    for use in uses:
        with _announced_lock:
            if use in _announced:
                continue
            _announced.add(use)
        if use.kind == "alias":
            _log.warning("upstream_env_alias", variable=use.old, use_instead=use.new)
        elif use.kind == "ignored":
            _log.warning(
                "upstream_env_ignored", variable=use.old, use_instead=use.new, reason="both set"
            )
        else:
            _log.warning("upstream_env_unsupported", variable=use.old, instead=use.advice)
    return out


__all__ = [
    "ALIASED",
    "GATEWAY_PREFIX",
    "NEW_PREFIX",
    "UNSUPPORTED",
    "UPSTREAM_PREFIX",
    "UpstreamUse",
    "new_name",
    "resolve_upstream_env",
    "with_upstream_aliases",
]
