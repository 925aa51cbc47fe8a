"""Gateway-driven compaction under lpt_packing: after a repack, the workers whose assigned models
changed free their on-demand weights, so the models that left them stop holding device memory.

``compaction_jobs`` (pure) says which worker gets which reload list; ``Compactor`` sends them.
A repack runs on the prober's round and must not wait for workers, so it only ``submit``s the
jobs; the compactor's ``run`` task (in the gateway's task tree) fans ``CompactMemory`` out to
those workers concurrently, each call isolated (a failure is logged and counted, the others go
on), and records what it sent in ``history``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.config import CompactionMode
from kserve_trio.gateway.fleet import WorkerClient, compact_timeout
from kserve_trio.gateway.placement.assignment import Assignment
from kserve_trio.proto import reactant_control as rc

COMPACT_MEMORY = "/reactant_control.ControlService/CompactMemory"

_log = get_logger(__name__)


def compaction_jobs(
    old: Assignment, new: Assignment, changed: Sequence[str], mode: CompactionMode
) -> dict[str, list[str]]:
    """Worker -> the models its CompactMemory reloads: none under ``eager``; under
    ``scheduled`` the models newly assigned to it (sorted). Only ``changed`` workers."""
    jobs: dict[str, list[str]] = {}
    for worker in sorted(changed):
        if mode is CompactionMode.SCHEDULED:
            jobs[worker] = sorted(set(new.models_on(worker)) - set(old.models_on(worker)))
        else:
            jobs[worker] = []
    return jobs


@dataclass(frozen=True)
class CompactionRound:
    """One fan-out: each worker's reload list and outcome (``ok`` or the error)."""

    jobs: Mapping[str, tuple[str, ...]]
    outcomes: Mapping[str, str] = field(default_factory=dict)


class Compactor:
    """Sends the submitted compaction jobs (see the module docstring)."""

    def __init__(
        self,
        clients: Callable[[], Mapping[str, WorkerClient]],
        *,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        self._clients = clients
        self._observe = observe
        self._send, self._receive = anyio.create_memory_object_stream[dict[str, list[str]]](
            math.inf
        )
        self.history: list[CompactionRound] = []
        self.failures = 0

    def submit(self, jobs: dict[str, list[str]]) -> None:
        """Queue one fan-out (never blocks)."""
        if jobs:
            self._send.send_nowait(jobs)

    async def run(self) -> None:
        """Send queued fan-outs until cancelled (a task of the gateway's tree)."""
        async with self._receive:
            async for jobs in self._receive:
                await self.fan_out(jobs)

    async def fan_out(self, jobs: Mapping[str, list[str]]) -> CompactionRound:
        clients = self._clients()
        outcomes: dict[str, str] = {}

        async def one(label: str, reload: list[str]) -> None:
            client = clients.get(label)
            if client is None:
                outcomes[label] = "worker left the pool"
                return
            started = anyio.current_time()
            timeout = compact_timeout(client.request_timeout)
            try:
                with anyio.fail_after(timeout + 1.0):
                    await client.call(
                        COMPACT_MEMORY,
                        rc.CompactMemoryRequest(reload_models=reload),
                        rc.CompactMemoryResponse,
                        timeout=timeout,
                    )
                outcomes[label] = "ok"
            except (RpcError, TimeoutError) as exc:
                outcomes[label] = str(exc) or type(exc).__name__
                self.failures += 1
            finally:
                if self._observe is not None:
                    self._observe(label, anyio.current_time() - started)

        async with anyio.create_task_group() as tg:
            for label, reload in sorted(jobs.items()):
                tg.start_soon(one, label, reload)
        done = CompactionRound({k: tuple(v) for k, v in sorted(jobs.items())}, outcomes)
        self.history.append(done)
        failed = {k: v for k, v in outcomes.items() if v != "ok"}
        log = _log.warning if failed else _log.info
        log("lpt_compaction_fanned_out", workers=dict(sorted(outcomes.items())))
        return done


__all__ = ["COMPACT_MEMORY", "CompactionRound", "Compactor", "compaction_jobs"]
