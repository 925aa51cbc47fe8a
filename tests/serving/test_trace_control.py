"""``TraceControl``: a process whose configuration has tracing off builds its tracer at the first
TraceSetting change that traces, once however many such changes arrive together, and tells every
subscriber; other changes, and refused ones, build nothing (``trace_mode`` naming the one mode
is accepted); before a tracer exists the caller's context is never read."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import CollectorRegistry

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.process.config import TracingConfig
from kserve_trio.proto import inference as pb
from kserve_trio.serving.trace_control import TraceControl

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def _request(model: str = "", **settings: list[str]) -> pb.TraceSettingRequest:
    value = pb.TraceSettingRequestSettingValue
    return pb.TraceSettingRequest(
        settings={k: value(value=v) for k, v in settings.items()}, model_name=model
    )


def _control(registry: CollectorRegistry | None = None) -> TraceControl:
    # Nothing is traced in these tests: the endpoint is never posted to.
    config = TracingConfig(endpoint="http://127.0.0.1:9/v1/traces")
    return TraceControl(config, role="worker", metric_prefix="test", registry=registry)


async def test_concurrent_turn_ons_build_one_tracer_and_tell_each_subscriber_once():
    registry = CollectorRegistry()
    control = _control(registry)
    told: list[object] = []
    control.when_started(told.append)
    replies: list[pb.TraceSettingResponse] = []

    async def turn_on(model: str) -> None:
        replies.append(await control.answer(_request(model, trace_level=["TIMESTAMPS"])))

    async with anyio.create_task_group() as tg:
        for model in ("", "mlp", "cnn"):
            tg.start_soon(turn_on, model)
    try:
        assert control.tracer is not None and told == [control.tracer]
        assert [r.settings["trace_level"].value for r in replies] == [["TIMESTAMPS"]] * 3
        assert registry.get_sample_value("test_traces_dropped_total") == 0
        late: list[object] = []
        control.when_started(late.append)  # after the start: told at once
        assert late == [control.tracer]
        assert control.tracer.settings is control.settings  # the settings changed before it
    finally:
        control.close()


async def test_changes_that_do_not_trace_or_are_refused_build_nothing():
    control = _control()
    reply = await control.answer(_request("mlp", trace_rate=["5"], trace_level=["OFF"]))
    assert reply.settings["trace_rate"].value == ["5"]
    # trace_mode is read-only, and naming the one mode along with other settings is accepted.
    reply = await control.answer(_request(trace_mode=["opentelemetry"], trace_count=["3"]))
    assert reply.settings["trace_count"].value == ["3"]
    with pytest.raises(InvalidArgument):  # all or nothing: the valid level is not applied
        await control.answer(_request(trace_level=["TIMESTAMPS"], trace_rate=["0"]))
    assert control.tracer is None
    assert control.settings.effective().level == "OFF"
    read = await control.answer(_request())
    assert read.settings["trace_level"].value == ["OFF"]
    control.close()  # nothing to flush


async def test_the_callers_context_is_read_only_once_a_tracer_exists():
    control = _control()
    asked: list[str] = []

    def header(name: str) -> str | None:
        asked.append(name)
        return "00-" + "a" * 32 + "-" + "b" * 16 + "-01" if name == "traceparent" else None

    assert control.caller_context(header) is None and asked == []
    await control.answer(_request(trace_level=["TIMESTAMPS"]))
    try:
        assert control.caller_context(header) == "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
        assert asked == ["traceparent", "tracestate"]
    finally:
        control.close()
