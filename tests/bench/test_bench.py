"""The load generator: its pure pieces, the matplotlib chart, and short runs against a live worker."""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable

import anyio
import numpy as np
import pytest
from trio.testing import MockClock

from kserve_trio.bench import (
    BenchConfig,
    Window,
    latency_series,
    parse_concurrency,
    percentiles,
    plot_latency,
    report,
    run_bench,
    status_name,
    synth_inputs,
    table,
)
from kserve_trio.bench._drive import _drive_level
from kserve_trio.client import PoolAcquireTimeout, RpcError
from kserve_trio.client.spec import ModelIOSpec, TensorMeta
from kserve_trio.core.errors import StatusCode


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --------------------------------------------------------------------------------------------
# Pure pieces


def test_parse_concurrency():
    assert parse_concurrency("1,8,32") == (1, 8, 32)
    assert parse_concurrency("4") == (4,)
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_concurrency(bad)


def test_percentiles_in_milliseconds():
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert p["max"] == pytest.approx(100.0) and p["mean"] == pytest.approx(50.5)
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}


def test_status_names():
    assert status_name(RpcError(StatusCode.RESOURCE_EXHAUSTED, "x")) == "RESOURCE_EXHAUSTED"
    assert status_name(PoolAcquireTimeout(1, 5)) == "POOL_ACQUIRE_TIMEOUT"
    assert status_name(KeyError("k")) == "KeyError"

    class TritonLike(Exception):
        def status(self):
            return "StatusCode.UNAVAILABLE"

    assert status_name(TritonLike()) == "UNAVAILABLE"


def test_window_summary_and_report():
    w = Window(4, latencies=[0.002] * 90, errors=Counter({"UNAVAILABLE": 10}), seconds=2.0)
    w.cpu_seconds = 0.05
    s = w.summary(batch=8)
    assert (s["requests"], s["ok"], s["items"]) == (100, 90, 720)
    assert (s["requests_per_s"], s["items_per_s"]) == (45.0, 360.0)
    assert s["errors"] == {"UNAVAILABLE": 10}
    assert s["cpu_per_request_us"] == 500.0
    assert s["latency_ms"]["p50"] == 2.0
    cfg = BenchConfig("h:1", "m", (4,), duration=2.0, batch=8)
    rep = report(cfg, [w])
    assert rep["mode"] == "closed loop" and rep["levels"] == [s]
    assert report(BenchConfig("h:1", "m", rate=50), [])["mode"] == "fixed rate 50/s"
    text = table(rep)
    assert text.splitlines()[0] == "m via kserve_trio (inline, batch 8, closed loop)"
    assert "UNAVAILABLE=10" in text.splitlines()[2]


def test_synthetic_inputs_follow_the_spec():
    spec = ModelIOSpec(
        [TensorMeta("a", "FP32", (-1, 3, -1)), TensorMeta("b", "INT32", (2,))], [], "m"
    )
    arrays = synth_inputs(spec, 5)
    assert arrays["a"].shape == (5, 3, 1) and arrays["a"].dtype == np.float32
    assert arrays["b"].shape == (2,) and not arrays["b"].any()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_a_level_counts_ok_errors_and_late_starts(anyio_backend):
    # on trio's MockClock (it jumps to the next timer whenever every task waits) and the loop's
    # clock as the level's: a 1 ms call takes 1 ms and the schedule is exact, however loaded
    # the machine
    calls = 0

    async def call():
        nonlocal calls
        calls += 1
        n = calls
        await anyio.sleep(0.001)
        if n % 4 == 0:
            raise RpcError(StatusCode.RESOURCE_EXHAUSTED, "shed")

    def drive(cfg: BenchConfig, concurrency: int, call) -> Awaitable[Window]:
        return _drive_level(cfg, concurrency, call, clock=anyio.current_time)

    cfg = BenchConfig("h:1", "m", duration=0.3, warmup=0.0, progress=False)
    w = await drive(cfg, 2, call)
    assert w.errors["RESOURCE_EXHAUSTED"] == calls // 4
    assert len(w.latencies) == calls - calls // 4
    assert w.seconds == pytest.approx(0.3, abs=0.002)
    assert calls == pytest.approx(2 * 300, abs=2)  # two closed loops of 1 ms calls

    calls = 0
    rated = BenchConfig("h:1", "m", duration=0.5, warmup=0.0, rate=40, progress=False)
    w = await drive(rated, 1, call)
    assert calls == 20  # 40/s for 0.5 s
    assert w.late == 0  # a 1 ms call never outlasts the 25 ms period

    async def slow_call():
        nonlocal calls
        calls += 1
        await anyio.sleep(0.06)  # outlasts the 25 ms period: the one slot is busy at every start

    calls = 0
    w = await drive(rated, 1, slow_call)
    assert calls >= 2 and w.late == calls - 1  # every start after the first found it busy


def test_latency_series_are_the_report_percentiles_by_concurrency():
    rep = {
        "levels": [
            {"concurrency": 1, "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}},
            {"concurrency": 8, "latency_ms": {"p50": 2.0, "p90": 4.0, "p99": 9.0}},
        ]
    }
    assert latency_series(rep) == {
        "p50": [(1, 1.0), (8, 2.0)],
        "p90": [(1, 2.0), (8, 4.0)],
        "p99": [(1, 3.0), (8, 9.0)],
    }


def test_plot_draws_every_series_in_its_own_color(tmp_path):
    from matplotlib import image
    from matplotlib.colors import to_rgb
    from matplotlib.pyplot import rcParams

    rep = {
        "model": "m",
        "client": "kserve_trio",
        "transport": "inline",
        "batch": 1,
        "levels": [
            {"concurrency": 1, "latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}},
            {"concurrency": 8, "latency_ms": {"p50": 2.0, "p90": 4.0, "p99": 9.0}},
        ],
    }
    out = tmp_path / "chart.png"
    plot_latency(rep, str(out))
    assert png_size(out.read_bytes()) == (720, 440)
    rgb = image.imread(str(out))[..., :3].reshape(-1, 3)
    for color in rcParams["axes.prop_cycle"].by_key()["color"][:3]:
        distance = np.abs(rgb - np.asarray(to_rgb(color))).max(axis=1)
        assert (distance < 0.02).sum() > 20, f"series color {color} not drawn"


# --------------------------------------------------------------------------------------------
# Against a live worker


@pytest.fixture(scope="module")
def server(demo_worker):
    """The suite's shared demo worker (this module only sends it requests)."""
    return demo_worker


def test_bench_command_writes_report_progress_and_plot(server, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kserve_trio",
            "bench",
            "--url",
            server.address,
            "--model",
            "mlp",
            "--concurrency",
            "1,2",
            "--duration",
            "0.5",
            "--warmup",
            "0.1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "[c=1 inline kserve_trio]" in result.stderr
    assert "[c=2 inline kserve_trio]" in result.stderr
    assert result.stdout.splitlines()[0] == "mlp via kserve_trio (inline, batch 1, closed loop)"
    rep = json.loads(out_json.read_text())
    assert [lv["concurrency"] for lv in rep["levels"]] == [1, 2]
    for lv in rep["levels"]:
        assert lv["ok"] > 10 and lv["errors"] == {}
        assert lv["items_per_s"] == lv["requests_per_s"]
        assert 0 < lv["latency_ms"]["p50"] <= lv["latency_ms"]["p90"] <= lv["latency_ms"]["p99"]
        assert lv["cpu_per_request_us"] > 0
    assert png_size(out_png.read_bytes()) == (720, 440)


def test_bench_over_shared_memory_with_a_batch_and_a_fixed_rate(server):
    cfg = BenchConfig(
        server.address,
        "cnn",
        (2,),
        duration=0.5,
        warmup=0.1,
        rate=40,
        transport="shm",
        batch=4,
        progress=False,
    )
    rep = run_bench(cfg)
    (lv,) = rep["levels"]
    assert lv["errors"] == {}
    assert 15 <= lv["ok"] <= 21
    assert lv["items"] == 4 * lv["ok"]


def test_bench_with_tritonclient_and_its_refusals(server):
    rep = run_bench(
        BenchConfig(
            server.address,
            "mlp",
            (1,),
            duration=0.3,
            warmup=0.1,
            client="tritonclient",
            progress=False,
        )
    )
    assert rep["levels"][0]["ok"] > 5 and rep["levels"][0]["errors"] == {}
    with pytest.raises(ValueError, match="--client tritonclient supports --transport inline only"):
        run_bench(BenchConfig(server.address, "mlp", client="tritonclient", transport="shm"))
    with pytest.raises(RpcError) as info:
        run_bench(BenchConfig(server.address, "nope", (1,), duration=0.1, progress=False))
    assert info.value.status is StatusCode.NOT_FOUND
