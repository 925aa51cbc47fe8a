"""The worker pool: one HTTP/2 connection per worker, a bound on its in-flight calls, probes,
and the health state machine that decides when a worker is ready and when its connection is
reset.

The state machine is pure (``probe_step``, ``forward_deadline``); the I/O is at
the edges, in ``WorkerClient`` (one worker's connection) and ``WorkerPool`` (the clients of the
current worker set, reconciled with each discovery round).

Each ``WorkerClient`` owns one ``H2Transport`` to the worker's resolved address (TLS checked
against the host name in ``endpoints``) and a semaphore of ``max_concurrent_streams``: a
forwarded call waits for a slot, within its deadline, so one slow worker holds at most that many
of the gateway's requests. Calls are raw: the request bytes go out as received and the reply
bytes come back unparsed (``RawReply``). A client that cancels its call cancels the gateway's
task, which resets the worker stream (RST_STREAM CANCEL), so the worker sees the cancellation.
Probes (ServerReady) and control-plane calls bypass the slots: a worker whose slots are all busy
must still be probed.
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import anyio
import betterproto2

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint, method_path
from kserve_trio.core.errors import DeadlineExceeded, StatusCode
from kserve_trio.core.process import parse_header
from kserve_trio.gateway.caller_headers import passed_on
from kserve_trio.gateway.config import GatewayConfig
from kserve_trio.gateway.fleet.discovery import WorkerDiff, WorkerSpec
from kserve_trio.gateway.tls import worker_ssl_context
from kserve_trio.http2 import DEFAULT_ENGINE
from kserve_trio.proto import inference as pb

R = TypeVar("R")

PROBE_TIMEOUT_SECONDS = 5.0
"""ServerReady, RepositoryIndex, ModelControlStatus and IsSameIPCNamespace: a healthy worker
answers these in milliseconds."""
COMPACT_TIMEOUT_SECONDS = 300.0
"""CompactMemory frees and reloads weights: it gets at least this long."""

SERVER_READY = method_path("ServerReady")


class RawReply(bytes):
    """The reply type of a raw call: the worker's reply message bytes, unparsed (``FromString``
    hands them back as they are; the class is a ``bytes`` so that typed callers see bytes)."""

    @staticmethod
    def FromString(data: bytes) -> bytes:  # the name the transport calls
        return data


# ---------------------------------------------------------------------------------------------
# The pure state machine


class ProbeOutcome(enum.Enum):
    """How one ServerReady probe ended."""

    READY = "ready"
    """The worker answered ready."""
    NOT_READY = "not_ready"
    """The worker answered, not ready (loading, draining)."""
    FAILED = "failed"
    """The call failed quickly: refused, reset, or an error status."""
    TIMED_OUT = "timed_out"
    """No answer within the probe timeout."""


@dataclass(frozen=True)
class WorkerHealth:
    """One worker's health as the prober sees it."""

    ready: bool = False
    answered: bool = False
    """Whether the worker has ever answered a probe (ready or not)."""
    consecutive_timeouts: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class HealthStep:
    """The result of one probe: the new health and what the caller must do about it."""

    health: WorkerHealth
    reset_channel: bool = False
    """Close the worker's connection (the next call reconnects)."""
    became_ready: bool = False
    """The worker is ready and was not: replay its shared-memory registrations before routing
    to it."""
    became_unready: bool = False


def probe_step(health: WorkerHealth, outcome: ProbeOutcome, error: str = "") -> HealthStep:
    """The next health after a probe.

    Rules:
    1. READY: ready; the worker has answered; the timeout streak ends.
    2. NOT_READY: not ready; it has answered; the streak ends.
    3. FAILED: not ready (``error`` is kept); the streak ends: a quick failure means the
       connection machinery works, only the worker is not serving.
    4. TIMED_OUT: not ready; the streak grows; the connection is reset, since a call that
       gets no answer at all may be stuck on a dead or wedged connection, and a fresh one is
       the cure.
    ``became_ready`` / ``became_unready`` report a change of ``ready``.
    """
    ready = outcome is ProbeOutcome.READY
    answered = health.answered or outcome in (ProbeOutcome.READY, ProbeOutcome.NOT_READY)
    timed_out = outcome is ProbeOutcome.TIMED_OUT
    new = WorkerHealth(
        ready=ready,
        answered=answered,
        consecutive_timeouts=health.consecutive_timeouts + 1 if timed_out else 0,
        last_error="" if outcome is ProbeOutcome.READY else error,
    )
    return HealthStep(
        health=new,
        reset_channel=timed_out,
        became_ready=ready and not health.ready,
        became_unready=health.ready and not ready,
    )


def forward_deadline(deadline: float | None, now: float, default: float, model: str) -> float:
    """The absolute deadline to forward one attempt with (``anyio.current_time()`` clock).

    ``deadline`` is the client's own (``None``: it set none, and the worker-client default
    ``default`` seconds from ``now`` applies). It is forwarded exactly, never rounded: the
    worker gets the time that is really left. A deadline already passed raises
    ``DeadlineExceeded`` ("deadline exceeded at gateway for model 'm'") and nothing is sent.
    """
    if deadline is None:
        return now + default
    if not deadline - now > 0:
        raise DeadlineExceeded(model, f"deadline exceeded at gateway for model '{model}'")
    return deadline


# ---------------------------------------------------------------------------------------------
# One worker's connection


@dataclass(frozen=True)
class PoolSettings:
    """What every worker client is built with (from ``GatewayConfig``)."""

    max_concurrent_streams: int = 32
    request_timeout: float = 60.0
    max_send_message_length: int = 512 << 20
    max_receive_message_length: int = 512 << 20
    ssl_context: ssl.SSLContext | None = None
    headers: Mapping[str, str] | None = None  # on the gateway's own calls (worker_client.headers)
    http2_engine: str = DEFAULT_ENGINE  # the gateway's own (``http2_engine``), both sides

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> PoolSettings:
        """Settings of ``cfg``; builds the worker TLS context (``ConfigError`` if its files
        cannot be loaded)."""
        return cls(
            max_concurrent_streams=cfg.worker_client.max_concurrent_streams,
            request_timeout=cfg.worker_client.request_timeout_seconds,
            max_send_message_length=cfg.grpc.max_send_msg_bytes,
            max_receive_message_length=cfg.grpc.max_recv_msg_bytes,
            ssl_context=worker_ssl_context(cfg.worker_client.tls),
            http2_engine=cfg.http2_engine,
            headers=dict(
                parse_header(h, "worker_client.headers") for h in cfg.worker_client.headers
            )
            or None,
        )


class WorkerClient:
    """One worker: its connection, its in-flight bound, its health (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, settings: PoolSettings) -> None:
        self.spec = spec
        self.health = WorkerHealth()
        self.request_timeout = settings.request_timeout
        self.max_concurrent_streams = settings.max_concurrent_streams
        self._slots = anyio.Semaphore(settings.max_concurrent_streams)
        self._endpoint = Endpoint(
            host=spec.address,
            port=spec.port,
            secure=settings.ssl_context is not None,
            max_send_message_length=settings.max_send_message_length,
            max_receive_message_length=settings.max_receive_message_length,
            ssl_context=settings.ssl_context,
            http2_engine=settings.http2_engine,
        )
        self.transport = H2Transport(self._endpoint, server_hostname=spec.host)
        self.own_headers = settings.headers
        self.resets = 0

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def in_flight(self) -> int:
        """Forwarded calls holding a stream slot now."""
        return self.max_concurrent_streams - self._slots.value

    async def call_raw(
        self,
        method: str,
        payload: bytes,
        *,
        deadline: float | None = None,
        metadata: Mapping[str, str] | None = None,
        compressed_with: str | None = None,
    ) -> bytes:
        """Forward ``payload`` to ``method`` and return the reply bytes, within ``deadline``
        (absolute, ``anyio.current_time()`` clock; ``None``: ``request_timeout`` from now).
        ``compressed_with``: ``payload`` is a message compressed with that ``grpc-encoding``,
        forwarded as it is.

        The wait for a stream slot counts against the deadline; the worker is given exactly
        the time left when the call is sent. Without ``metadata`` of its own the call carries
        the caller's headers, or the gateway's own outside any caller (``caller_headers``). Failures are ``RpcError``s: the worker's status
        unchanged, or the transport's UNAVAILABLE / DEADLINE_EXCEEDED.
        """
        if deadline is None:
            deadline = anyio.current_time() + self.request_timeout
        rpc = method[method.rfind("/") + 1 :]
        acquired = False
        if self._slots.value > 0:  # the usual case: no checkpoint, no cancel scope
            self._slots.acquire_nowait()
            acquired = True
        else:
            with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)):
                await self._slots.acquire()
                acquired = True
        if not acquired:
            raise RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline exceeded at the gateway waiting for a free stream to {self.label}",
                method=rpc,
            )
        try:
            left = deadline - anyio.current_time()
            return await self.transport.unary(
                method,
                payload,
                RawReply,
                timeout=max(left, 0.0),
                metadata=passed_on(metadata, self.own_headers),
                compressed_with=compressed_with,
            )
        finally:
            self._slots.release()

    async def call(
        self,
        method: str,
        request: betterproto2.Message | bytes,
        reply_type: type[R],
        *,
        timeout: float,
    ) -> R:
        """A control-plane call (no stream slot); a call that times out resets the connection,
        for the reason ``probe_step``'s TIMED_OUT rule gives."""
        try:
            return await self.transport.unary(
                method,
                request,
                reply_type,
                timeout=timeout,
                metadata=passed_on(None, self.own_headers),
            )
        except RpcError as exc:
            if exc.status is StatusCode.DEADLINE_EXCEEDED:
                await self.reset()
            raise

    async def probe(
        self, timeout: float = PROBE_TIMEOUT_SECONDS
    ) -> tuple[ProbeOutcome, HealthStep]:
        """ServerReady once; update ``health`` (resetting the connection when the step says
        so) and return the outcome and the step."""
        outcome, error = await self._probe_once(timeout)
        step = probe_step(self.health, outcome, error)
        self.health = step.health
        if step.reset_channel:
            await self.reset()
        return outcome, step

    async def _probe_once(self, timeout: float) -> tuple[ProbeOutcome, str]:
        try:
            with anyio.fail_after(timeout + 1.0):  # the transport's own bound, plus margin
                reply = await self.transport.unary(
                    SERVER_READY, pb.ServerReadyRequest(), pb.ServerReadyResponse, timeout=timeout
                )
        except TimeoutError:
            return ProbeOutcome.TIMED_OUT, f"no answer within {timeout:g}s"
        except RpcError as exc:
            if exc.status is StatusCode.DEADLINE_EXCEEDED:
                return ProbeOutcome.TIMED_OUT, exc.message
            return ProbeOutcome.FAILED, f"{exc.status.name}: {exc.message}"
        if reply.ready:
            return ProbeOutcome.READY, ""
        return ProbeOutcome.NOT_READY, "the worker answered not ready"

    async def reset(self) -> None:
        """Drop the connection; calls on it fail UNAVAILABLE and the next call reconnects."""
        self.resets += 1
        await self.transport.aclose()

    async def aclose(self) -> None:
        await self.transport.aclose()


# ---------------------------------------------------------------------------------------------
# The pool


class WorkerPool:
    """The clients of the current worker set, by label.

    ``apply`` reconciles the pool with a discovery round's diff: added workers get a client,
    removed ones are closed, changed ones keep their connection unless the host their TLS
    certificate is checked against changed. The pool never opens a connection by itself:
    connecting is the first call's job.
    """

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self._clients: dict[str, WorkerClient] = {}

    @property
    def clients(self) -> Mapping[str, WorkerClient]:
        return dict(self._clients)

    def get(self, label: str) -> WorkerClient | None:
        return self._clients.get(label)

    def _new(self, spec: WorkerSpec) -> WorkerClient:
        return WorkerClient(spec, self.settings)

    async def apply(self, diff: WorkerDiff) -> None:
        """Reconcile with ``diff`` (see the class docstring)."""
        closing: list[WorkerClient] = []
        for spec in diff.removed:
            client = self._clients.pop(spec.label, None)
            if client is not None:
                closing.append(client)
        for old, new in diff.changed:
            client = self._clients.pop(old.label, None)
            if client is None or old.host != new.host:
                if client is not None:
                    closing.append(client)
                client = self._new(new)
            else:
                client.spec = new
            self._clients[new.label] = client
        for spec in diff.added:
            self._clients[spec.label] = self._new(spec)
        for client in closing:
            await client.aclose()

    async def probe_all(
        self, timeout: float = PROBE_TIMEOUT_SECONDS
    ) -> dict[str, tuple[ProbeOutcome, HealthStep]]:
        """Probe every worker concurrently; label -> (outcome, step)."""
        results: dict[str, tuple[ProbeOutcome, HealthStep]] = {}

        async def one(client: WorkerClient) -> None:
            results[client.label] = await client.probe(timeout)

        async with anyio.create_task_group() as tg:
            for client in self._clients.values():
                tg.start_soon(one, client)
        return dict(sorted(results.items()))

    def ready_labels(self) -> list[str]:
        return sorted(label for label, c in self._clients.items() if c.health.ready)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


def compact_timeout(request_timeout: float) -> float:
    """CompactMemory's timeout: the request timeout, but never under five minutes."""
    return max(request_timeout, COMPACT_TIMEOUT_SECONDS)


__all__ = [
    "COMPACT_TIMEOUT_SECONDS",
    "PROBE_TIMEOUT_SECONDS",
    "HealthStep",
    "PoolSettings",
    "ProbeOutcome",
    "RawReply",
    "WorkerClient",
    "WorkerHealth",
    "WorkerPool",
    "compact_timeout",
    "forward_deadline",
    "probe_step",
]
