"""One process's tracing as its configuration and Triton's TraceSetting RPC control it: the trace
settings (``trace_settings.TraceSettings``, always there) and the tracer (``tracing.Tracing``),
which exists only once something traces.

The tracer is built at start-up when the configuration says ``tracing.level: timestamps``, and
otherwise by the first TraceSetting change that is not ``OFF`` (Triton turns tracing on live the
same way), so a process started with tracing off imports nothing of OpenTelemetry until then.
That build (the import, the exporter and its thread) runs on a worker thread, so the event loop
goes on serving while it happens; a change arriving meanwhile waits for the same build. Without
the ``tracing`` extra installed, such a change is FAILED_PRECONDITION naming the extra (nothing
of it is applied). Once built, the tracer stays until the process ends: turning ``OFF`` again
stops the spans (the settings sample nothing).

The parts that trace (the inference core, the dispatch loop, the gateway's services) subscribe
with ``when_started`` and keep the tracer in a field of their own, so a request's one test stays
``is None`` on an attribute it already has. ``caller_context`` is the header reader of a path
that must be ready before the tracer exists (the worker's gRPC ModelInfer, whose method is built
once): it reads nothing while there is no tracer.

This module imports nothing of OpenTelemetry.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from kserve_trio.core.errors import FailedPrecondition
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import TracingConfig
from kserve_trio.proto import inference as pb
from kserve_trio.serving.trace_settings import (
    TraceSettings,
    caller_context,
    parse_changes,
    requested_changes,
    settings_reply,
    turns_on,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kserve_trio.serving.tracing import Tracing

log = get_logger("kserve_trio.tracing")

EXTRA = "tracing"
"""The package extra that installs OpenTelemetry (pyproject.toml's ``tracing``)."""
EXTRA_DISTRIBUTIONS = (
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
)
EXTRA_MISSING = (
    f"tracing needs the '{EXTRA}' extra, which is not installed here "
    f"(pip install 'kserve_trio[{EXTRA}]')"
)


def tracing_installed() -> bool:
    """Whether the ``tracing`` extra is installed, asked of the installed distributions' metadata
    so that nothing of OpenTelemetry is imported (``opentelemetry`` is a namespace package: even
    ``find_spec`` of a submodule would import it)."""
    for name in EXTRA_DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return False
    return True


class TraceControl:
    """One process's trace settings and its tracer, built when first needed (module docstring)."""

    def __init__(
        self,
        config: TracingConfig,
        *,
        role: str,
        metric_prefix: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.settings = TraceSettings(config)
        self.tracer: Tracing | None = None
        """The tracer once built (None: nothing has traced yet)."""
        self._role = role
        self._metric_prefix = metric_prefix
        self._registry = registry
        self._subscribers: list[Callable[[Tracing], None]] = []
        self._building: anyio.Event | None = None

    def when_started(self, subscriber: Callable[[Tracing], None]) -> None:
        """Call ``subscriber`` with the tracer once it exists (now, if it does)."""
        self._subscribers.append(subscriber)
        if self.tracer is not None:
            subscriber(self.tracer)

    def open_configured(self) -> None:
        """At start-up: build the tracer now when the configuration traces."""
        if self.config.on and self.tracer is None:
            self._started(self._build())

    def caller_context(self, header: Callable[[str], str | None]) -> str | None:
        """The caller's W3C context (``trace_settings.caller_context``) once there is a tracer;
        None, with no header read, before."""
        if self.tracer is None:
            return None
        return caller_context(header)

    async def answer(self, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
        """The TraceSetting RPC: change what the request names for its model (or globally), all
        or nothing, building the tracer first when the change turns tracing on; answer with
        every setting in force there. A request without settings only reads them."""
        model = request.model_name
        changes = requested_changes(request)
        if not changes:
            return settings_reply(self.settings.effective(model))
        parsed = parse_changes(changes)
        if self.tracer is None and turns_on(parsed):
            await self._open_live()
        setting = self.settings.update(model, parsed)
        log.info(
            "trace_settings_updated",
            model=model or None,
            **{k: ",".join(v) if v else "<cleared>" for k, v in changes.items()},
        )
        return settings_reply(setting)

    async def _open_live(self) -> None:
        """Build the tracer on a worker thread, once: a second change arriving meanwhile waits
        for the first one's build (and its failure raises its own)."""
        while self._building is not None:
            await self._building.wait()
        if self.tracer is not None:
            return
        self._building = building = anyio.Event()
        try:
            tracer = await anyio.to_thread.run_sync(self._build)
            self._started(tracer)
            log.info("tracing_started_live", role=self._role)
        finally:
            self._building = None
            building.set()

    def _build(self) -> Tracing:
        try:
            from kserve_trio.serving.tracing import open_tracing
        except ImportError as exc:
            raise FailedPrecondition(f"{EXTRA_MISSING}: {exc}") from None
        return open_tracing(
            self.config,
            role=self._role,
            metric_prefix=self._metric_prefix,
            registry=self._registry,
            settings=self.settings,
        )

    def _started(self, tracer: Tracing) -> None:
        self.tracer = tracer
        for subscriber in self._subscribers:
            subscriber(tracer)

    def close(self) -> None:
        """At shutdown (blocking: run it on a thread): the tracer's last spans go out, within
        one export timeout. Nothing to do when none was built."""
        if self.tracer is not None:
            self.tracer.close()


__all__ = [
    "EXTRA",
    "EXTRA_MISSING",
    "TraceControl",
    "tracing_installed",
]
