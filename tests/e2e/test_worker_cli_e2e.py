"""A worker started from the CLI, driven by the stock ``tritonclient`` (sync and aio)."""

from __future__ import annotations

import asyncio
import shutil
import threading

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from tests.e2e import reference as ref
from tests.e2e.test_protocol_features_e2e import sample
from tests.gate_model import add_gate_model
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DEMO = ["cnn", "mlp", "mlp_bf16", "mlp_softmax", "scale4"]


def infer(client, model, name, x, datatype="FP32", outputs=None, **kw):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    outs = [grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, [inp], outputs=outs, **kw)


def test_health_metadata_and_repository_index(demo_worker):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    assert c.is_server_live()
    assert c.is_server_ready()
    meta = c.get_server_metadata(as_json=True)
    assert meta["name"] == "kserve_trio"
    assert meta["version"]
    assert meta["extensions"] == [
        "model_repository",
        "model_configuration",
        "system_shared_memory",
        "parameters",
        "statistics",
        "trace",
        "logging",
    ]
    for model in DEMO:
        assert c.is_model_ready(model)
    assert not c.is_model_ready("nope")
    md = c.get_model_metadata("cnn", as_json=True)
    assert md["inputs"] == [
        {"name": "input_0", "datatype": "FP32", "shape": ["-1", "3", "32", "32"]}
    ]
    assert md["outputs"] == [{"name": "output", "datatype": "FP32", "shape": ["-1", "10"]}]
    md = c.get_model_metadata("mlp_softmax", as_json=True)
    assert md["outputs"][0]["name"] == "probs"
    index = c.get_model_repository_index(as_json=True)
    assert [m["name"] for m in index["models"]] == DEMO
    assert all(m["state"] == "READY" for m in index["models"])


def test_every_demo_model_is_numerically_correct(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    rng = np.random.default_rng(1)
    w = ref.weights(demo_repo, "mlp")
    for rows in (1, 3, 8, 64):
        x = rng.standard_normal((rows, 16), dtype=np.float32)
        r = infer(c, "mlp", "input_0", x, request_id=f"req-{rows}")
        np.testing.assert_allclose(r.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        assert r.get_response().id == f"req-{rows}"
    x = rng.standard_normal((3, 16), dtype=np.float32)  # 3 rows padded to the compiled size 8
    r = infer(c, "mlp_softmax", "input_0", x)
    probs = r.as_numpy("probs")
    np.testing.assert_allclose(
        probs, ref.softmax(ref.mlp(x, ref.weights(demo_repo, "mlp_softmax"))), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    x = rng.standard_normal((5, 3, 32, 32), dtype=np.float32)
    r = infer(c, "cnn", "input_0", x)
    np.testing.assert_allclose(
        r.as_numpy("output"), ref.cnn(x, ref.weights(demo_repo, "cnn")), rtol=1e-4, atol=1e-4
    )
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    r = infer(c, "scale4", "x", x)
    np.testing.assert_array_equal(r.as_numpy("y"), [2, 4, 6, 8])
    x = rng.standard_normal((2, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)
    r = infer(c, "mlp_bf16", "input_0", x, datatype="BF16")
    wb = {k: v.astype(np.float32) for k, v in ref.weights(demo_repo, "mlp_bf16").items()}
    np.testing.assert_allclose(
        r.as_numpy("output").astype(np.float32), ref.mlp(x, wb), rtol=5e-2, atol=5e-2
    )


def test_requested_output_subset_and_unknown_output(demo_worker):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    x = np.ones((1, 16), dtype=np.float32)
    r = infer(c, "mlp", "input_0", x, outputs=["output"])
    assert r.as_numpy("output").shape == (1, 8)
    with pytest.raises(InferenceServerException) as err:
        infer(c, "mlp", "input_0", x, outputs=["logits"])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "has no output 'logits'" in err.value.message()


def test_aio_client_concurrent_inference(demo_worker, demo_repo):
    w = ref.weights(demo_repo, "mlp")

    async def main():
        client = aioclient.InferenceServerClient(demo_worker.url)
        try:
            assert await client.is_server_ready()
            xs = [np.full((1, 16), i, dtype=np.float32) for i in range(16)]

            async def one(x):
                inp = aioclient.InferInput("input_0", [1, 16], "FP32")
                inp.set_data_from_numpy(x)
                return (await client.infer("mlp", [inp])).as_numpy("output")

            outs = await asyncio.gather(*(one(x) for x in xs))
            for x, out in zip(xs, outs, strict=True):
                np.testing.assert_allclose(out, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        finally:
            await client.close()

    asyncio.run(main())


def test_sigterm_with_32_requests_in_flight_exits_cleanly(demo_repo, tmp_path):
    from tests.e2e.conftest import WorkerProcess

    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "cnn", repo / "cnn")
    gate = add_gate_model(repo)  # holds the device: the 32 requests wait in its queue
    metrics_port = free_port()
    worker = WorkerProcess(repo, "--metrics-port", str(metrics_port))
    worker.metrics_port = metrics_port
    worker.wait_ready()
    outcomes: list[str] = []
    seconds = grpcclient.InferInput("seconds", [1, 1], "FP32")
    seconds.set_data_from_numpy(np.zeros((1, 1), np.float32))
    holder = grpcclient.InferenceServerClient(worker.url)
    held: list[str] = []

    def hold() -> None:
        try:
            holder.infer("gate", [seconds])
            held.append("OK")
        except InferenceServerException as exc:
            held.append(str(exc.status()))

    hold_thread = threading.Thread(target=hold, daemon=True)
    hold_thread.start()
    gate.wait_started()

    async def load():
        client = aioclient.InferenceServerClient(worker.url)
        try:

            async def one(i):
                x = np.full((32, 3, 32, 32), i, dtype=np.float32)
                inp = aioclient.InferInput("input_0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                try:
                    await client.infer("cnn", [inp])
                    return "OK"
                except InferenceServerException as exc:
                    return exc.status()

            tasks = [asyncio.create_task(one(i)) for i in range(32)]
            all_queued = lambda: sample(worker, "worker_queue_depth", "cnn") == 32  # noqa: E731
            await asyncio.to_thread(wait_until, all_queued, 60, "the 32 requests queued")
            children = _children(worker.proc.pid)
            t0 = asyncio.get_running_loop().time()
            worker.proc.send_signal(__import__("signal").SIGTERM)
            # the queued ones are answered while the device is still held
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            gate.open()  # the drain waits for the execution on the device
            code = await asyncio.to_thread(worker.proc.wait, 10)
            return results, code, asyncio.get_running_loop().time() - t0, children
        finally:
            await client.close()

    try:
        results, code, elapsed, children = asyncio.run(load())
    finally:
        gate.open()
        hold_thread.join(30)
    outcomes.extend(results)
    worker.terminate()
    assert code == 0, worker.logs()[-3000:]
    assert elapsed < 5.0
    assert outcomes == ["StatusCode.UNAVAILABLE"] * 32  # queued at the signal: answered, not run
    assert held == ["OK"]  # the one on the device finished
    assert children == []  # the worker never forks helpers
    assert '"server_down"' in worker.logs()


def _children(pid: int) -> list[int]:
    import pathlib

    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out.extend(int(k) for k in kids)
    return out
