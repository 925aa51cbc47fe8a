"""Dynamic mode under load: add, reweight, rename and delete a bundle while mlp keeps serving."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from safetensors.numpy import load_file, save_file
from tritonclient.utils import InferenceServerException

from kserve_trio.worker import heartbeat
from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

POLL = 0.25
AFTER_CHANGES = 50
"""Requests the closed-loop load on mlp must still get served after the last change."""


def mlp_infer(c, model, x):
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp]).as_numpy("output")


def status(c, model, x):
    try:
        mlp_infer(c, model, x)
        return "OK"
    except InferenceServerException as exc:
        return exc.status()


def compilations(running, model):
    samples = running.state.metrics.compilations.labels(model=model)
    return samples._value.get()


def test_add_reweight_rename_delete_under_load(demo_repo, tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "mlp", repo / "mlp")
    staging = tmp_path / "staging"
    shutil.copytree(demo_repo / "mlp", staging / "b")
    events: list[tuple[str, str]] = []
    beat = heartbeat.register_heartbeat(
        lambda e, d: events.append((e, d)) if e in ("load", "unload") else None
    )
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(repo)],
        model_control_mode="dynamic",
        model_poll_seconds=POLL,
        endpoints={"port": 0},
    )
    stop_load = threading.Event()
    failures: list[str] = []
    served = [0]
    w_mlp = ref.weights(repo, "mlp")

    def load():
        c = grpcclient.InferenceServerClient(running.address)
        x = np.random.default_rng(0).standard_normal((2, 16), dtype=np.float32)
        expected = ref.mlp(x, w_mlp)
        while not stop_load.is_set():
            try:
                np.testing.assert_allclose(mlp_infer(c, "mlp", x), expected, rtol=1e-5, atol=1e-5)
                served[0] += 1
            except Exception as exc:
                failures.append(repr(exc))

    loader = threading.Thread(target=load)
    loader.start()
    try:
        c = grpcclient.InferenceServerClient(running.address)
        x = np.ones((1, 16), np.float32)
        # 1. add B
        t0 = time.monotonic()
        shutil.copytree(staging / "b", repo / "b")
        wait_until(lambda: status(c, "b", x) == "OK", 2 * POLL + 10)
        np.testing.assert_allclose(
            mlp_infer(c, "b", x), ref.mlp(x, ref.weights(repo, "b")), rtol=1e-5
        )
        assert time.monotonic() - t0 < 2 * POLL + 10
        assert compilations(running, "b") == 1
        # 2. rewrite B's weights (same layout, new values)
        w = load_file(str(repo / "b" / "weights.safetensors"))
        w2 = {k: (v * 3.0).astype(v.dtype) for k, v in w.items()}
        tmp = repo / "b" / "weights.tmp"
        save_file(w2, str(tmp), metadata={"argument_order": '["w1", "b1", "w2", "b2"]'})
        tmp.replace(repo / "b" / "weights.safetensors")
        expected = ref.mlp(x, w2)
        wait_until(
            lambda: np.allclose(mlp_infer(c, "b", x), expected, rtol=1e-5, atol=1e-5), 2 * POLL + 10
        )
        assert compilations(running, "b") == 2
        # 3. rename B -> C: no recompilation, the old name disappears
        (repo / "b").rename(repo / "c")
        wait_until(lambda: status(c, "c", x) == "OK", 2 * POLL + 10)
        assert status(c, "b", x) == "StatusCode.NOT_FOUND"
        assert compilations(running, "c") == 0
        np.testing.assert_allclose(mlp_infer(c, "c", x), expected, rtol=1e-5, atol=1e-5)
        # 4. delete C
        shutil.rmtree(repo / "c")
        wait_until(lambda: status(c, "c", x) == "StatusCode.NOT_FOUND", 2 * POLL + 10)
        # 5. a bundle copied in slowly (a file every half poll) never loads half-written
        (repo / "slow").mkdir()
        for f in sorted((staging / "b").iterdir(), key=lambda p: p.name != "manifest.yaml"):
            shutil.copy2(f, repo / "slow" / f.name)
            time.sleep(POLL / 2)
        wait_until(lambda: status(c, "slow", x) == "OK", 2 * POLL + 10)
        assert compilations(running, "slow") == 1
        after = served[0] + AFTER_CHANGES
        wait_until(lambda: served[0] >= after, 30)
    finally:
        stop_load.set()
        loader.join()
        stop(running)
        heartbeat.unregister_heartbeat(beat)
    assert failures == []
    assert served[0] > AFTER_CHANGES
    assert events == [("load", "b"), ("load", "b"), ("unload", "c"), ("load", "slow")]
