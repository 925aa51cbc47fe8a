"""The pure parts behind the gateway's fan-out and admin answers: merges of the workers'
replies, admission and drain, the stream response framing, the hosts-file resolver and
the metadata passed on to workers."""

from __future__ import annotations

import anyio
import pytest
from trio.testing import MockClock

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import ResourceExhausted, StatusCode, Unavailable
from kserve_trio.gateway.fleet.discovery import hosts_file_resolver, parse_hosts
from kserve_trio.gateway.request_path import aggregate
from kserve_trio.gateway.request_path.admission import SHUTTING_DOWN, Admission
from kserve_trio.gateway.request_path.service import forwarded_metadata
from kserve_trio.gateway.request_path.stream import stream_error, stream_response
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc


def entry(name: str, state: str, reason: str = "", version: str = "1"):
    return pb.RepositoryIndexResponseModelIndex(
        name=name, version=version, state=state, reason=reason
    )


def test_the_repository_index_is_the_union_and_ready_anywhere_is_ready():
    a = pb.RepositoryIndexResponse(
        models=[entry("m", "UNAVAILABLE", "unloaded"), entry("k", "READY")]
    )
    b = pb.RepositoryIndexResponse(models=[entry("m", "READY"), entry("z", "LOADING", "busy")])
    merged = aggregate.union_repository_index([a, b])
    assert [(m.name, m.state, m.reason) for m in merged.models] == [
        ("k", "READY", ""),
        ("m", "READY", ""),
        ("z", "LOADING", "busy"),
    ]
    only_a = aggregate.union_repository_index([a])
    assert [(m.name, m.state, m.reason) for m in only_a.models] == [
        ("k", "READY", ""),
        ("m", "UNAVAILABLE", "unloaded"),
    ]
    assert aggregate.union_repository_index([]).models == []


def dur(count: int, ns: int) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=count, ns=ns)


def test_statistics_are_summed_per_model_batch_size_memory_and_response_key():
    a = pb.ModelStatisticsResponse(
        model_stats=[
            pb.ModelStatistics(
                name="m", version="1", last_inference=5, inference_count=3, execution_count=2,
                inference_stats=pb.InferStatistics(success=dur(3, 30), queue=dur(3, 6)),
                batch_stats=[pb.InferBatchStatistics(batch_size=1, compute_infer=dur(2, 20))],
                memory_usage=[pb.MemoryUsage(type="CPU", id=0, byte_size=10)],
                response_stats={"k": pb.InferResponseStatistics(success=dur(1, 1))},
            )
        ]
    )  # fmt: skip
    b = pb.ModelStatisticsResponse(
        model_stats=[
            pb.ModelStatistics(
                name="m", version="1", last_inference=9, inference_count=4, execution_count=1,
                inference_stats=pb.InferStatistics(success=dur(4, 40), fail=dur(1, 2)),
                batch_stats=[
                    pb.InferBatchStatistics(batch_size=8, compute_infer=dur(1, 7)),
                    pb.InferBatchStatistics(batch_size=1, compute_infer=dur(1, 5)),
                ],
                memory_usage=[pb.MemoryUsage(type="CPU", id=0, byte_size=5)],
                response_stats={"k": pb.InferResponseStatistics(success=dur(2, 2))},
            ),
            pb.ModelStatistics(name="k", version="1", inference_count=1),
        ]
    )  # fmt: skip
    (m, k) = aggregate.sum_model_statistics([a, b]).model_stats
    assert (m.name, m.last_inference, m.inference_count, m.execution_count) == ("m", 9, 7, 3)
    assert m.inference_stats.success == dur(7, 70)
    assert m.inference_stats.fail == dur(1, 2) and m.inference_stats.queue == dur(3, 6)
    assert [(s.batch_size, s.compute_infer) for s in m.batch_stats] == [
        (1, dur(3, 25)),
        (8, dur(1, 7)),
    ]
    assert m.memory_usage == [pb.MemoryUsage(type="CPU", id=0, byte_size=15)]
    assert m.response_stats["k"].success == dur(3, 3)
    assert (k.name, k.inference_count) == ("k", 1)


def test_same_ipc_namespace_needs_every_worker_and_at_least_one():
    assert aggregate.same_ipc_namespace([True, True]) is True
    assert aggregate.same_ipc_namespace([True, False]) is False
    assert aggregate.same_ipc_namespace([True, None]) is False  # an error counts false
    assert aggregate.same_ipc_namespace([]) is False


def test_compaction_totals_and_the_first_failure_in_label_order():
    totals = aggregate.sum_compact_memory(
        [rc.CompactMemoryResponse(reloaded_models=1, resident_bytes_after=10)] * 3
    )
    assert (totals.reloaded_models, totals.resident_bytes_after) == (3, 30)
    b_err = RpcError(StatusCode.FAILED_PRECONDITION, "b says no")
    a_err = RpcError(StatusCode.INTERNAL, "a broke")
    assert aggregate.first_failure({"b": b_err, "a": a_err, "c": b""}) == ("a", a_err)
    assert aggregate.first_failure({"a": b"", "b": b""}) is None


def test_shm_status_comes_from_the_remembered_registrations():
    reqs = [
        bytes(pb.SystemSharedMemoryRegisterRequest(name=n, key=f"/{n}", offset=o, byte_size=64))
        for n, o in (("b", 8), ("a", 0))
    ]
    every = aggregate.shm_status(reqs)
    assert list(every.regions) == ["a", "b"] and every.regions["b"].offset == 8
    assert list(aggregate.shm_status(reqs, "a").regions) == ["a"]
    assert aggregate.shm_status(reqs, "nope").regions == {}


def test_the_cap_follows_the_worker_count_and_sheds_past_it():
    workers = [2]
    shed = []
    adm = Admission(3, lambda: workers[0], on_shed=lambda: shed.append(1))
    assert adm.cap == 6
    for _ in range(6):
        adm.admit_inference()
    with pytest.raises(ResourceExhausted, match=r"admission cap \(6 requests in flight: 3 per"):
        adm.admit_inference()
    assert adm.shed == 1 and shed == [1]
    workers[0] = 3  # a worker appeared: the cap grows
    adm.admit_inference()
    assert adm.inflight == 7
    workers[0] = 0
    assert adm.cap == 3  # never below one worker's worth
    assert Admission(0, lambda: 5).cap == 0  # uncapped
    unlimited = Admission(0, lambda: 1)
    for _ in range(1000):
        unlimited.admit_inference()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_drain_refuses_everything_and_waits_for_what_is_in_flight(anyio_backend):
    # on trio's MockClock (it jumps to the next timer whenever every task waits): the drain's
    # bound and the releases below happen at exact times, however loaded the machine
    adm = Admission(4, lambda: 1)
    adm.admit_inference()
    adm.admit_call()
    adm.start_drain()
    assert adm.draining and adm.drain_started.is_set()
    for admit in (adm.admit_inference, adm.admit_call):
        with pytest.raises(Unavailable, match=SHUTTING_DOWN):
            admit()
    t0 = anyio.current_time()
    assert await adm.drained(0.05) is False  # still busy: bounded
    assert anyio.current_time() - t0 == pytest.approx(0.05)

    async def finish() -> None:
        await anyio.sleep(0.05)
        adm.release_inference()
        await anyio.sleep(0.05)
        adm.release_call()

    t0 = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        assert await adm.drained(5) is True
        assert anyio.current_time() - t0 == pytest.approx(0.1)  # when the last one ended
    assert adm.busy == 0


def test_a_stream_response_embeds_the_workers_reply_bytes_unchanged():
    reply = pb.ModelInferResponse(model_name="m", id="r7", raw_output_contents=[b"\x01" * 300])
    framed = stream_response(bytes(reply))
    assert framed.endswith(bytes(reply))
    parsed = pb.ModelStreamInferResponse.parse(framed)
    assert parsed.error_message == "" and parsed.infer_response.id == "r7"
    assert parsed.infer_response.raw_output_contents == [b"\x01" * 300]
    err = pb.ModelStreamInferResponse.parse(stream_error("boom", "m", "r8"))
    assert (err.error_message, err.infer_response.model_name, err.infer_response.id) == (
        "boom",
        "m",
        "r8",
    )


def test_the_hosts_format_and_the_hosts_file_resolver(tmp_path):
    text = "# comment\n127.0.0.1 a.test b.test\n127.0.0.2 A.TEST # two\nnot-an-ip c.test\n::1 v6.test\n"
    assert parse_hosts(text) == {
        "a.test": ["127.0.0.1", "127.0.0.2"],
        "b.test": ["127.0.0.1"],
        "v6.test": ["::1"],
    }
    path = tmp_path / "hosts"
    path.write_text(text)
    asked = []

    async def fallback(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["10.0.0.9"]

    resolve = hosts_file_resolver(str(path), fallback)

    async def go() -> None:
        assert await resolve("A.test", 1) == ["127.0.0.1", "127.0.0.2"]
        assert await resolve("elsewhere.test", 1) == ["10.0.0.9"]
        path.write_text("127.0.0.3 a.test\n")  # read again on every call
        assert await resolve("a.test", 1) == ["127.0.0.3"]
        path.unlink()  # unreadable: as if empty
        assert await resolve("a.test", 1) == ["10.0.0.9"]

    anyio.run(go)
    assert asked == ["elsewhere.test", "a.test"]


def test_only_the_callers_own_metadata_is_passed_on():
    assert forwarded_metadata({}) is None
    assert forwarded_metadata({"x-trace": "1", "host": "h", "connection": "c"}) == {"x-trace": "1"}
    assert forwarded_metadata({"host": "h"}) is None
