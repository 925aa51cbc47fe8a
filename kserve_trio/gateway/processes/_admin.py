"""The parent's admin port: one ``/metrics``, ``/healthz``, ``/readyz`` and ``/routing`` for
all the gateway's processes.

Each child serves its own admin endpoints on a loopback port it announced (``_layout``); the
parent asks the children that are up, concurrently, at request time, each within
``CHILD_ANSWER_SECONDS``: a child that has not answered by then (stopped, or too busy) is left
out of that answer, so every page is ready within about that long whatever one child does, well
inside a kubelet probe's 1 s (a child that keeps not answering is killed and restarted,
``_children`` rule 4):

- ``/metrics``: the parent's own series (``gateway_processes``, ``gateway_process_up``,
  ``gateway_process_restarts_total``, ``gateway_process_metrics_up`` and its process
  collector), then every child's ``/metrics/own`` with ``gateway_process="<i>"`` added to each
  sample (the parent's own samples get ``gateway_process="parent"``), then the workers'
  expositions, asked of the lowest-numbered child that is up (``/metrics/workers``) so each
  worker appears once (asked at the same time as the rest; when that child did not answer,
  asked once more of the lowest-numbered child that answered ``/metrics/own``). One ``metrics_merge.merge_expositions`` makes it one exposition. Each
  child is a plain registry scraped over HTTP, so every collector of a child (lpt_packing's
  among them) is kept; prometheus_client's multiprocess mode is not used.
- ``/healthz``: 200 while the parent serves.
- ``/readyz``: 200 while the parent is not draining and at least one child answers its own
  ``/readyz`` 200 in time (it answers as soon as one does) (a connection the kernel hands to a child that is not ready is still
  answered: that child says UNAVAILABLE), else 503.
- ``/routing``: ``processes`` maps each up child that answered in time, by index, to its own ``/routing`` document;
  ``models`` and ``workers`` are the intersection over those children: a replica is listed for
  a model, and a worker is ready, only when every child that answered says so (what a client
  may rely on whichever process its connection reached).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.process_collector import ProcessCollector

from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.admin import ScrapeError, fetch
from kserve_trio.gateway.metrics import CONTENT_TYPE
from kserve_trio.gateway.processes._children import LOOPBACK, GatewayChild
from kserve_trio.serving.admin_http import Route
from kserve_trio.serving.metrics_merge import ExpositionError, add_label, merge_expositions

PROCESS_LABEL = "gateway_process"
CHILD_ANSWER_SECONDS = 0.5
"""How long an admin page waits for each child's answer (module docstring)."""
_TEXT = "text/plain; charset=utf-8"

_log = get_logger("kserve_trio.gateway.processes")


class _ParentCollector:
    """The parent's view of its children, read when scraped."""

    def __init__(self, children: Sequence[GatewayChild], metrics_up: dict[int, bool]) -> None:
        self._children = children
        self._metrics_up = metrics_up

    def describe(self) -> list:
        return []

    def collect(self):
        count = GaugeMetricFamily("gateway_processes", "Gateway processes configured")
        count.add_metric([], len(self._children))
        yield count
        up = GaugeMetricFamily(
            "gateway_process_up", "1 while the gateway process serves", labels=[PROCESS_LABEL]
        )
        restarts = CounterMetricFamily(
            "gateway_process_restarts",
            "Times the gateway process was restarted after it exited",
            labels=[PROCESS_LABEL],
        )
        killed = CounterMetricFamily(
            "gateway_process_liveness_kills",
            "Times the gateway process was killed for missing its liveness probes",
            labels=[PROCESS_LABEL],
        )
        scraped = GaugeMetricFamily(
            "gateway_process_metrics_up",
            "1 if the gateway process answered this scrape",
            labels=[PROCESS_LABEL],
        )
        for child in self._children:
            label = [str(child.index)]
            up.add_metric(label, 1.0 if child.admin_port is not None else 0.0)
            restarts.add_metric(label, child.restarts)
            killed.add_metric(label, child.liveness_kills)
            scraped.add_metric(label, 1.0 if self._metrics_up.get(child.index) else 0.0)
        yield up
        yield restarts
        yield killed
        yield scraped


class ProcessesAdmin:
    """The parent's admin routes (see the module docstring)."""

    def __init__(self, children: Sequence[GatewayChild], draining: Callable[[], bool]) -> None:
        self.children = children
        self._draining = draining
        self._metrics_up: dict[int, bool] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.registry.register(_ParentCollector(children, self._metrics_up))

    def routes(self) -> dict[str, Route]:
        return {
            "/metrics": self.metrics_page,
            "/readyz": self.ready_page,
            "/routing": self.routing_page,
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def up_children(self) -> list[tuple[int, int]]:
        """``(index, admin port)`` of every child that is up, by index."""
        return [(c.index, c.admin_port) for c in self.children if c.admin_port is not None]

    async def _ask(self, index: int, port: int, path: str) -> tuple[int, bytes] | None:
        """Child ``index``'s answer to ``GET path``, or ``None`` when it gave none in time."""
        try:
            return await fetch(LOOPBACK, port, path, CHILD_ANSWER_SECONDS)
        except ScrapeError as exc:
            _log.warning(
                "gateway_process_admin_failed", gateway_process=index, path=path, error=str(exc)
            )
            return None

    async def _ask_all(
        self, path: str, enough: Callable[[tuple[int, bytes]], bool] = lambda _: False
    ) -> dict[int, tuple[int, bytes]]:
        """Every up child's answer to ``GET path`` that came in time; the others are not
        waited for once one answer is ``enough``."""
        answers: dict[int, tuple[int, bytes]] = {}

        async def one(index: int, port: int, tg: anyio.abc.TaskGroup) -> None:
            answer = await self._ask(index, port, path)
            if answer is not None:
                answers[index] = answer
                if enough(answer):
                    tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, port in self.up_children():
                tg.start_soon(one, index, port, tg)
        return answers

    async def metrics_page(self) -> tuple[int, str, bytes]:
        up = self.up_children()
        answers: dict[int, tuple[int, bytes]] = {}
        workers: dict[int, tuple[int, bytes] | None] = {}

        async def children_own() -> None:
            answers.update(await self._ask_all("/metrics/own"))

        async def workers_of(index: int, port: int) -> None:
            workers[index] = await self._ask(index, port, "/metrics/workers")

        async with anyio.create_task_group() as tg:
            tg.start_soon(children_own)
            if up:
                tg.start_soon(workers_of, *up[0])
        if up and workers[up[0][0]] is None:
            answered = [(i, port) for i, port in up[1:] if i in answers]
            if answered:
                await workers_of(*answered[0])
        worker_texts = [
            answer[1].decode("utf-8", "replace")
            for answer in workers.values()
            if answer is not None and answer[0] == 200
        ]
        texts: list[str] = []
        self._metrics_up.clear()
        for index, (status, body) in sorted(answers.items()):
            if status != 200:
                continue
            try:
                texts.append(add_label(body.decode("utf-8", "replace"), PROCESS_LABEL, str(index)))
                self._metrics_up[index] = True
            except ExpositionError as exc:
                _log.warning(
                    "gateway_process_metrics_malformed", gateway_process=index, error=str(exc)
                )
        own = add_label(self.exposition().decode("utf-8"), PROCESS_LABEL, "parent")
        try:
            merged = merge_expositions([own, *texts, *worker_texts])
        except ExpositionError as exc:
            _log.warning("gateway_process_metrics_merge_failed", error=str(exc))
            merged = own
        return 200, CONTENT_TYPE, merged.encode("utf-8")

    async def ready(self) -> bool:
        if self._draining():
            return False
        answers = await self._ask_all("/readyz", enough=lambda answer: answer[0] == 200)
        return any(status == 200 for status, _ in answers.values())

    async def ready_page(self) -> tuple[int, str, bytes]:
        if await self.ready():
            return 200, _TEXT, b"ok"
        return 503, _TEXT, b"not ready"

    async def routing_page(self) -> tuple[int, str, bytes]:
        answers = await self._ask_all("/routing")
        documents: dict[str, Any] = {}
        for index, (status, body) in sorted(answers.items()):
            if status == 200:
                try:
                    documents[str(index)] = json.loads(body)
                except ValueError:
                    continue
        body = json.dumps(
            {**routing_intersection(list(documents.values())), "processes": documents}, indent=1
        )
        return 200, "application/json", body.encode("utf-8")


def routing_intersection(documents: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``models`` and ``workers`` of several ``/routing`` documents, as every one of them says
    (see the module docstring); empty for no document."""
    if not documents:
        return {"models": {}, "workers": []}
    models: dict[str, list[str]] = {}
    for name, labels in documents[0].get("models", {}).items():
        common = [
            label
            for label in labels
            if all(label in doc.get("models", {}).get(name, ()) for doc in documents[1:])
        ]
        if common:
            models[name] = common
    ready: dict[str, bool] = {}
    for doc in documents:
        for entry in doc.get("workers", []):
            worker = entry.get("worker")
            ready[worker] = ready.get(worker, True) and bool(entry.get("ready"))
    return {
        "models": models,
        "workers": [{"worker": w, "ready": ready[w]} for w in sorted(ready)],
    }


__all__ = ["CHILD_ANSWER_SECONDS", "PROCESS_LABEL", "ProcessesAdmin", "routing_intersection"]
