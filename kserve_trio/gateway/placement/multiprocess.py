"""lpt_packing in a gateway of several processes: one placement, every process's arrivals, one
control plane.

Process 0 is the *placer*: its ``LptScheduler`` runs as in a single gateway (start-up checks,
ticks, repacks, compaction, the control RPCs). The others are *followers*: their scheduler never
places; they route by the placer's placement. Through the runtime directory
(``processes._layout``):

- ``lpt-placement.json`` (the placer writes it after each repack, after each control change
  and at each of its prober rounds, with a version that grows each time): the assignment,
  the knobs (with the per-model overrides as ``models``) and the repack bookkeeping. A
  follower looks for a new version every ``PLACEMENT_POLL_SECONDS`` and adopts it; a
  follower's start-up waits for the placer's first placement;
- ``lpt-arrivals-<i>.json`` (follower ``i`` writes it at each poll that has news): the
  requests per model it has routed since it started, with its pid, and the version it
  adopted last. At each repack the placer adds every follower's growth since the last repack
  to its own arrivals (a follower that restarted counts from zero), so the arrival rates are
  the whole gateway's traffic (a follower's last ``PLACEMENT_POLL_SECONDS`` count at the next
  repack). A control change (SetSchedulingPolicy, SetModelPlacement, Repack) is answered
  once every follower has adopted it (``GatewayControl.settled``, at most
  ``SETTLE_SECONDS``), so what a client does next follows it through any process;
- ``lpt-control.json``: the loopback port of the placer's own control server (the
  GatewayControlService alone). A follower forwards every GatewayControlService call there as
  it arrived and returns the placer's answer as it came, so the service answers the same
  through any process; while the placer is not up, a follower answers UNAVAILABLE.

Per-process series stay per process (``gateway_replica_outstanding``,
``gateway_replica_routed_total``); the placement's (``gateway_placement_weight``,
``gateway_model_utilization``, ``gateway_repacks_total``) are the placer's, mirrored by each
follower. A placer that restarts starts over (its averages are not kept): a start-up repack by
memory alone, which the followers then follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import EdgeLimits, FrozenMap
from kserve_trio.gateway.config import GatewayConfig, build_gateway_config, gateway_config_to_raw
from kserve_trio.gateway.fleet import PoolSettings, RoutingMetadata, WorkerClient, WorkerSpec
from kserve_trio.gateway.placement.assignment import Assignment, Placement
from kserve_trio.gateway.placement.control import GatewayControl
from kserve_trio.gateway.placement.scheduler import LptScheduler, RepackReport
from kserve_trio.gateway.processes._layout import ProcessRole, write_atomically
from kserve_trio.serving.grpc import (
    Call,
    GrpcServer,
    Limits,
    Method,
    RawMessage,
    ServerSettings,
    raw_unary,
)

PLACEMENT_FILE = "lpt-placement.json"
CONTROL_FILE = "lpt-control.json"
PLACEMENT_POLL_SECONDS = 0.05
SETTLE_SECONDS = 2.0
"""How long a control change waits for the followers (one that is down does not hold it)."""
PLACER = 0
"""The index of the process that places."""

_log = get_logger(__name__)


def _arrivals_path(runtime_dir: Path, index: int) -> Path:
    return runtime_dir / f"lpt-arrivals-{index}.json"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def assignment_to_json(assignment: Assignment) -> dict[str, Any]:
    return {
        "placements": {
            m: {"workers": list(p.workers), "weights": list(p.weights)}
            for m, p in sorted(assignment.placements.items())
        },
        "load": dict(assignment.load),
        "memory": dict(assignment.memory),
        "warnings": list(assignment.warnings),
    }


def assignment_from_json(data: Mapping[str, Any]) -> Assignment:
    return Assignment(
        placements={
            m: Placement(tuple(p["workers"]), tuple(float(w) for w in p["weights"]))
            for m, p in data["placements"].items()
        },
        load={w: float(v) for w, v in data["load"].items()},
        memory={w: int(v) for w, v in data["memory"].items()},
        warnings=tuple(data["warnings"]),
    )


def _knobs_raw(scheduler: LptScheduler) -> dict[str, Any]:
    knobs = dataclasses.replace(scheduler.knobs, models=FrozenMap(scheduler.overrides))
    return gateway_config_to_raw(GatewayConfig(scheduling=knobs))["scheduling"]


class LptPlacer:
    """Process 0 (see the module docstring)."""

    def __init__(self, scheduler: LptScheduler, control: GatewayControl, role: ProcessRole) -> None:
        self.scheduler = scheduler
        self.control = control
        self.role = role
        self.sequence = 0
        self.version = 0
        self._seen: dict[int, tuple[object, dict[str, int]]] = {}
        scheduler.extra_arrivals = self.followers_arrivals
        scheduler.on_repack = self._repacked
        control.settled = self.settled
        own = scheduler.policy.on_metadata

        def on_metadata(metadata: RoutingMetadata) -> None:
            if own is not None:
                own(metadata)
            if scheduler.started:
                self.publish()

        scheduler.policy.on_metadata = on_metadata

    def _repacked(self, report: RepackReport) -> None:
        self.sequence += 1
        self.publish()

    def publish(self) -> None:
        s = self.scheduler
        self.version += 1
        body = {
            "pid": os.getpid(),
            "version": self.version,
            "sequence": self.sequence,
            "assignment": assignment_to_json(s.policy.assignment),
            "knobs": _knobs_raw(s),
            "generation": s.generation,
            "util": s.util,
            "ready": list(s.ready),
            "book": {"count": s.book.count, "by_trigger": s.book.by_trigger},
        }
        write_atomically(self.role.runtime_dir / PLACEMENT_FILE, json.dumps(body).encode())

    def _follower_reports(self) -> dict[int, dict[str, Any]]:
        out = {}
        for index in range(self.role.count):
            if index != PLACER:
                data = _read_json(_arrivals_path(self.role.runtime_dir, index))
                if isinstance(data, dict):
                    out[index] = data
        return out

    async def settled(self) -> None:
        """Publish now, then wait until every follower adopted it (at most ``SETTLE_SECONDS``;
        a follower not running does not hold it)."""
        self.publish()
        wanted = [os.getpid(), self.version]
        with anyio.move_on_after(SETTLE_SECONDS):
            while True:
                reports = self._follower_reports()
                behind = [
                    i
                    for i in range(self.role.count)
                    if i != PLACER and reports.get(i, {}).get("adopted") != wanted
                ]
                if not behind:
                    return
                await anyio.sleep(PLACEMENT_POLL_SECONDS / 2)
        _log.warning("lpt_followers_behind", processes=behind)

    def followers_arrivals(self) -> dict[str, int]:
        """Every follower's arrivals since the last call (module docstring)."""
        out: dict[str, int] = {}
        for index, data in self._follower_reports().items():
            pid, counts = data.get("pid"), data.get("counts") or {}
            seen_pid, seen = self._seen.get(index, (None, {}))
            if pid != seen_pid:
                seen = {}  # a new follower process counts from zero
            for model, n in counts.items():
                grown = n - seen.get(model, 0)
                if grown > 0:
                    out[model] = out.get(model, 0) + grown
            self._seen[index] = (pid, dict(counts))
        return out

    async def start(self) -> None:
        await self.scheduler.start()

    async def run(self, edge: EdgeLimits, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The placer's control server on loopback, announced in ``lpt-control.json``."""
        server = GrpcServer(self.control.methods(), ServerSettings(limits=edge))
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.serve, "127.0.0.1", 0)
            body = json.dumps({"pid": os.getpid(), "port": port}).encode()
            write_atomically(self.role.runtime_dir / CONTROL_FILE, body)
            task_status.started()


class LptFollower:
    """Every process but 0 (see the module docstring)."""

    def __init__(self, scheduler: LptScheduler, role: ProcessRole, limits: Limits) -> None:
        self.scheduler = scheduler
        self.role = role
        self.limits = limits
        self.followed: tuple[int, int] | None = None
        """(the placer's pid, its repack sequence) of the placement adopted last."""
        self.adopted: tuple[int, int] | None = None
        """(the placer's pid, its version) adopted last."""
        self._knobs: dict[str, Any] | None = None
        self._arrivals: dict[str, int] = {}
        self._placer: tuple[int, WorkerClient] | None = None
        self._stamp: tuple[int, int] | None = None
        scheduler.policy.on_metadata = None  # this process's ticks place nothing

    def poll(self) -> None:
        """Adopt a new version of the placement, report arrivals and the version adopted."""
        try:
            stat = (self.role.runtime_dir / PLACEMENT_FILE).stat()
            stamp = (stat.st_mtime_ns, stat.st_ino)
        except OSError:
            stamp = None
        news = False
        if stamp is not None and stamp != self._stamp:
            try:
                news = self.follow()
                self._stamp = stamp
            except Exception as exc:  # a bad file keeps the previous placement
                _log.exception("lpt_follow_failed", error=str(exc))
        arrivals = self.scheduler.policy.take_arrivals()
        for model, n in arrivals.items():
            self._arrivals[model] = self._arrivals.get(model, 0) + n
        if news or arrivals:
            self.publish_arrivals()

    def follow(self) -> bool:
        """Adopt the placer's placement when it changed; whether one is adopted now."""
        data = _read_json(self.role.runtime_dir / PLACEMENT_FILE)
        if not isinstance(data, dict):
            return self.followed is not None
        s = self.scheduler
        if data["knobs"] != self._knobs:
            knobs = build_gateway_config({"scheduling": data["knobs"]}).scheduling
            s.overrides = {m: o for m, o in knobs.models.items() if not o.empty}
            s.set_knobs(knobs)
            s.generation = int(data["generation"])
            self._knobs = data["knobs"]
        key = (int(data["pid"]), int(data["sequence"]))
        if key != self.followed:
            s.policy.repack(assignment_from_json(data["assignment"]))
            s.util = {m: float(v) for m, v in data["util"].items()}
            s.ready = tuple(data["ready"])
            s.book.count = int(data["book"]["count"])
            s.book.by_trigger = dict(data["book"]["by_trigger"])
            for m, p in s.policy.assignment.placements.items():
                s.pairs.update((m, w) for w in p.workers)
            self.followed = key
            _log.info("lpt_placement_followed", placer_pid=key[0], sequence=key[1])
        self.adopted = (int(data["pid"]), int(data["version"]))
        return True

    def publish_arrivals(self) -> None:
        body = {"pid": os.getpid(), "counts": self._arrivals, "adopted": self.adopted}
        write_atomically(
            _arrivals_path(self.role.runtime_dir, self.role.index), json.dumps(body).encode()
        )

    async def start(self) -> None:
        """Before serving: wait for the placer's first placement."""
        waited = False
        while not self.follow():
            if not waited:
                _log.info("lpt_waiting_for_the_placement", placer=PLACER)
                waited = True
            await anyio.sleep(PLACEMENT_POLL_SECONDS)

    async def _placer_client(self) -> WorkerClient:
        data = _read_json(self.role.runtime_dir / CONTROL_FILE)
        if not isinstance(data, dict):
            raise Unavailable("the gateway's placing process is not serving (it is starting)")
        port = int(data["port"])
        if self._placer is not None and self._placer[0] == port:
            return self._placer[1]
        if self._placer is not None:
            await self._placer[1].aclose()
        spec = WorkerSpec("127.0.0.1", port, "127.0.0.1", 0, f"gateway process {PLACER}")
        client = WorkerClient(spec, PoolSettings())
        self._placer = (port, client)
        return client

    def control_methods(self, paths: list[str]) -> dict[str, Method]:
        """``paths`` (the GatewayControlService methods) forwarded to the placer."""

        async def forward(path: str, call: Call, message: RawMessage) -> bytes:
            client = await self._placer_client()
            try:
                return await client.call_raw(path, bytes(call.plain(message)))
            except RpcError as exc:
                if exc.status.name == "UNAVAILABLE":
                    raise Unavailable(f"the gateway's placing process: {exc.message}") from None
                raise

        return {
            path: raw_unary(functools.partial(forward, path), self.limits, path.rsplit("/", 1)[1])
            for path in paths
        }

    async def run(self, edge: EdgeLimits, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Poll the placement (``poll``) until cancelled; close the connection to the placer."""
        try:
            task_status.started()
            while True:
                self.poll()
                await anyio.sleep(PLACEMENT_POLL_SECONDS)
        finally:
            if self._placer is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await self._placer[1].aclose()


def shared_lpt(
    scheduler: LptScheduler, control: GatewayControl, role: ProcessRole, limits: Limits
) -> LptPlacer | LptFollower:
    """The placer for process 0, a follower for the others."""
    if role.index == PLACER:
        return LptPlacer(scheduler, control, role)
    return LptFollower(scheduler, role, limits)


__all__ = [
    "CONTROL_FILE",
    "PLACEMENT_FILE",
    "PLACER",
    "LptFollower",
    "LptPlacer",
    "assignment_from_json",
    "assignment_to_json",
    "shared_lpt",
]
