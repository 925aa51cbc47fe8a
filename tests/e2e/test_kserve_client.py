"""KServe's own gRPC client (the kserve SDK's ``InferenceGRPCClient``, grpc.aio) against a CLI
worker on each HTTP/2 engine: readiness, model readiness and ModelInfer, whose answer equals
stock tritonclient's from the same worker.

The SDK runs from the deployment checks' environment (``.venv-deploy``, which ``tools/dev.sh
test`` creates): its pins must not reach the project's own."""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.http2 import ENGINES
from tests.deploy.conftest import deploy_python
from tests.gateway.procs import Worker
from tests.ports import free_port

pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceGRPCClient, InferInput, InferRequest

async def main(url):
    async with InferenceGRPCClient(url, timeout=30) as client:
        x = np.ones((3, 16), np.float32)
        inp = InferInput("input_0", [3, 16], "FP32")
        inp.set_data_from_numpy(x)
        result = await client.infer(InferRequest(model_name="mlp", infer_inputs=[inp]))
        out = result.outputs[0].as_numpy()
        print(json.dumps({
            "ready": await client.is_server_ready(),
            "model_ready": await client.is_model_ready("mlp"),
            "name": result.outputs[0].name,
            "output": out.tolist(),
        }))

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture(scope="module", params=ENGINES)
def worker(request, demo_repo: pathlib.Path):
    w = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        env={"INFERENCE_SERVER_ENDPOINTS_HTTP2_ENGINE": request.param},
    )
    try:
        w.wait_ready()
        yield w
    finally:
        assert w.stop() == 0, w.logs()


def test_kserves_grpc_client_is_served_and_agrees_with_tritonclient(worker: Worker):
    run = subprocess.run(
        [str(deploy_python()), "-c", SCRIPT, worker.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["ready"] is True and said["model_ready"] is True
    inp = grpcclient.InferInput("input_0", [3, 16], "FP32")
    inp.set_data_from_numpy(np.ones((3, 16), np.float32))
    want = grpcclient.InferenceServerClient(worker.url).infer("mlp", [inp]).as_numpy("output")
    assert said["name"] == "output"
    np.testing.assert_allclose(np.array(said["output"], np.float32), want, rtol=1e-6)
