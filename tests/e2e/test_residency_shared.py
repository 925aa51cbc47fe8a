"""Shared host weights across worker processes (``runtime.shared_host_weights: true``).

Two CLI workers on one repository hold one ``/dev/shm`` region per model: the first
materialises it from the weights file, the second attaches without reading the file (proved
by scrambling the file's tensor bytes -- size and mtime kept -- before the second starts: it
still serves the right numbers). A weights-only update gets a new region, never the old bytes,
and every region and lock file is gone once the last worker stops.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.core.bundles.bundle import WEIGHTS_FILE
from kserve_trio.core.memory.shm_names import SHM_DIR
from kserve_trio.runtime.weights import read_weights_index, write_weights
from tests.e2e import reference as ref
from tests.e2e.conftest import WorkerProcess

pytestmark = pytest.mark.slow

ENV = {
    "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS": "true",
    "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS_MODE": "660",
    "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": "10000000",
}


def events(worker: WorkerProcess, name: str, model: str) -> list[dict]:
    out = []
    for line in worker.logs().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name and record.get("model") == model:
            out.append(record)
    return out


def regions(model: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kst-w-{model}-*") if p.suffix != ".lock")


def files(model: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"kst-w-{model}-*"))


def infer(worker: WorkerProcess, model: str, x: np.ndarray) -> np.ndarray:
    c = grpcclient.InferenceServerClient(worker.url)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp]).as_numpy("output")


def scramble_keeping_identity(path) -> None:
    """Overwrite every tensor's bytes, keeping the file's size and mtime (its token)."""
    st = os.stat(path)
    index = read_weights_index(path)
    with open(path, "r+b") as fh:
        for e in index.entries:
            fh.seek(e.start)
            fh.write(b"\x7f" * e.nbytes)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def test_two_workers_share_one_region_per_model_and_updates_never_serve_stale(demo_repo, tmp_path):
    uid = uuid.uuid4().hex[:8]
    mlp, cnn = f"mlp_{uid}", f"cnn_{uid}"
    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "mlp", repo / mlp)
    shutil.copytree(demo_repo / "cnn", repo / cnn)
    w1 = ref.weights(repo, mlp)
    w_cnn = ref.weights(repo, cnn)
    x = np.random.default_rng(1).standard_normal((3, 16), dtype=np.float32)
    xc = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    workers: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        w = WorkerProcess(repo, "--log-level", "debug", env=ENV)
        workers.append(w)
        w.wait_ready()
        return w

    try:
        first = start()
        for model in (mlp, cnn):
            (made,) = events(first, "host_weights_materialized", model)
            assert made["region"] == "/" + regions(model)[0]
            assert events(first, "weights_file_read", model)
        assert len(regions(mlp)) == 1 and len(regions(cnn)) == 1
        v1_region = regions(mlp)[0]
        assert len(files(mlp)) == 2  # the region and its lock file beside it
        mode = (SHM_DIR / v1_region).stat().st_mode & 0o777
        assert mode == 0o660

        # From here the file's tensor bytes are garbage; only the shared region is right.
        scramble_keeping_identity(repo / mlp / WEIGHTS_FILE)
        second = start()
        for model in (mlp, cnn):
            (attached,) = events(second, "host_weights_attached", model)
            assert attached["bytes"] >= second_bytes(repo, model)
            assert not events(second, "host_weights_materialized", model)
            assert not events(second, "weights_file_read", model), "the file was read"
        assert regions(mlp) == [v1_region] and len(regions(cnn)) == 1
        for w in (first, second):
            np.testing.assert_allclose(infer(w, mlp, x), ref.mlp(x, w1), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(infer(w, cnn, xc), ref.cnn(xc, w_cnn), rtol=1e-4, atol=1e-4)

        # A weights-only update: same names, shapes and dtypes, new values and a new mtime.
        w2 = {k: (v * 2).astype(v.dtype) for k, v in w1.items()}
        order = [e.name for e in read_weights_index(repo / mlp / WEIGHTS_FILE).entries]
        write_weights(repo / mlp / WEIGHTS_FILE, [(k, w2[k]) for k in order])
        third = start()
        (made,) = events(third, "host_weights_materialized", mlp)
        assert made["region"] != "/" + v1_region
        assert sorted(regions(mlp)) == sorted([v1_region, made["region"].lstrip("/")])
        np.testing.assert_allclose(infer(third, mlp, x), ref.mlp(x, w2), rtol=1e-5, atol=1e-5)
        assert events(third, "host_weights_attached", cnn), "cnn did not change: shared"

        assert first.terminate() == 0
        assert v1_region in regions(mlp), "the second worker still holds version 1"
        assert second.terminate() == 0
        assert regions(mlp) == [made["region"].lstrip("/")]
        assert third.terminate() == 0
        assert files(mlp) == [] and files(cnn) == []
    finally:
        for w in workers:
            w.terminate()


def second_bytes(repo, model: str) -> int:
    return read_weights_index(repo / model / WEIGHTS_FILE).nbytes
