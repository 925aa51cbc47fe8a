"""RepositoryIndex after a bundle directory is deleted, through a real worker and the stock
tritonclient: the bundle leaves the index, whether it failed to load (dynamic and explicit
modes) or was compiled and is not ready (explicit mode, not resident); a model that is ready
stays listed while it serves."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.inprocess import in_process_worker
from tests.waiting import wait_until

BROKEN_MANIFEST = 'format_version: "2.0"\nkind: no-such-kind\n'
ARENA = 10_000_000
"""An on-demand device arena on the CPU, so explicit mode has residency to drive."""


@pytest.fixture
def models(demo_repo: Path, tmp_path: Path) -> Path:
    """``mlp`` and ``scale4`` from the demo repository, and ``broken``: a bundle whose
    manifest does not load."""
    root = tmp_path / "models"
    root.mkdir()
    for name in ("mlp", "scale4"):
        shutil.copytree(demo_repo / name, root / name)
    (root / "broken").mkdir()
    (root / "broken" / "manifest.yaml").write_text(BROKEN_MANIFEST)
    return root


def index(client: grpcclient.InferenceServerClient) -> dict[str, tuple[str, bool]]:
    """name -> (state, whether a reason is given) of the full repository index."""
    return {m.name: (m.state, bool(m.reason)) for m in client.get_model_repository_index().models}


def scale4_served(client: grpcclient.InferenceServerClient) -> bool:
    """``scale4`` answers: it doubles its input."""
    inp = grpcclient.InferInput("x", [4], "FP32")
    inp.set_data_from_numpy(np.array([1, 2, 3, 4], np.float32))
    result = client.infer("scale4", [inp])
    output = result.as_numpy("y") if result is not None else None
    return output is not None and output.tolist() == [2, 4, 6, 8]


def test_a_deleted_bundle_leaves_the_index_in_dynamic_mode(models: Path):
    with in_process_worker(models, model_control_mode="dynamic", model_poll_seconds=0.05) as w:
        c = grpcclient.InferenceServerClient(w.address)
        assert index(c) == {
            "broken": ("UNAVAILABLE", True),
            "mlp": ("READY", False),
            "scale4": ("READY", False),
        }
        shutil.rmtree(models / "broken")
        wait_until(lambda: "broken" not in index(c), 30, "the failed bundle leaves the index")
        shutil.rmtree(models / "mlp")  # a served one: the watcher unloads it
        wait_until(lambda: "mlp" not in index(c), 30, "the deleted model leaves the index")
        assert index(c) == {"scale4": ("READY", False)}
        assert [m.name for m in c.get_model_repository_index().models] == ["scale4"]


def test_a_deleted_bundle_leaves_the_index_in_explicit_mode(models: Path):
    with in_process_worker(
        models,
        model_control_mode="explicit",
        runtime={"cpu_device_memory_bytes": ARENA},
    ) as w:
        c = grpcclient.InferenceServerClient(w.address)
        c.load_model("scale4")
        assert index(c) == {
            "broken": ("UNAVAILABLE", True),
            "mlp": ("UNAVAILABLE", False),
            "scale4": ("READY", False),
        }
        for name in ("broken", "mlp", "scale4"):
            shutil.rmtree(models / name)
        # Nothing watches the repository in explicit mode: the index itself looks.
        assert index(c) == {"scale4": ("READY", False)}  # resident: still served
        assert scale4_served(c)
        c.unload_model("scale4")
        assert index(c) == {}
        ready_only = c.get_model_repository_index().models
        assert [m.name for m in ready_only] == []
