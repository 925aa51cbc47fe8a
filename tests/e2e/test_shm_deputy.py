"""The confused-deputy attack on shared host weights, end to end, with stock tritonclient.

Two CLI workers of one node share host weights (``runtime.shared_host_weights: true``): worker
A serves through two front ends (``--frontend-processes 2``), worker B by itself, a gateway
CLI is in front of both. The attacker lists ``/dev/shm``, finds ``mlp``'s weight region
(``kst-w-mlp-<digest>``) and its lock file, and on gRPC and REST, through a front end, straight
to a worker and through the gateway, registers region ``evil`` on the weight region's key: as
an output region (``mlp_softmax``'s output written at offset 64, over ``mlp``'s first weight
tensor), as an input region (to read the weights back) and on the lock file; then under a hard
link of its own name. Every registration is refused INVALID_ARGUMENT naming the rule; the
inferences naming ``evil`` fail; the region's bytes are unchanged and both workers' ``mlp``
answers equal numpy's, computed from the bundle's weights. Every ``/dev/shm`` object the
workers hold, and every front-end arena, is named under the reserved prefix, and every
worker maps the weight region read-only.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kserve_trio.core.memory.shm_names import RESERVED_PREFIX, RESERVED_RULE, SHM_DIR
from tests.e2e import reference as ref
from tests.e2e.conftest import WorkerProcess
from tests.gateway.procs import Gateway
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ENV = {
    "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS": "true",
    "INFERENCE_SERVER_RUNTIME_SHARED_HOST_WEIGHTS_MODE": "660",
    "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": "10000000",
}
X = np.ones((1, 16), np.float32)


class HttpWorker(WorkerProcess):
    """A CLI worker with a REST port too."""

    def __init__(self, repo: pathlib.Path, *extra: str) -> None:
        self.http_url = f"127.0.0.1:{free_port()}"
        super().__init__(repo, "--http-port", self.http_url.rsplit(":")[1], *extra, env=ENV)


def own_models(tmp: pathlib.Path, demo_repo: pathlib.Path) -> pathlib.Path:
    """``mlp`` and ``mlp_softmax`` with weights files of their own modification time, so their
    regions are this module's alone (the digest covers the file's size and mtime)."""
    repo = tmp / "models"
    repo.mkdir()
    stamp = time.time_ns() + os.getpid()
    for model in ("mlp", "mlp_softmax"):
        shutil.copytree(demo_repo / model, repo / model)
        os.utime(repo / model / "weights.safetensors", ns=(stamp, stamp))
    return repo


def weight_region(worker: WorkerProcess, model: str) -> str:
    """The region the worker logged for ``model``'s host weights (without the ``/``)."""
    for line in worker.logs().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("model") == model and record.get("event") in (
            "host_weights_materialized",
            "host_weights_attached",
        ):
            return record["region"].lstrip("/")
    raise AssertionError(f"no host weights logged for {model}:\n{worker.logs()[-3000:]}")


@pytest.fixture(scope="module")
def node(demo_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("deputy")
    repo = own_models(work, demo_repo)
    a = HttpWorker(repo, "--frontend-processes", "2")
    b = HttpWorker(repo)
    gw = None
    try:
        a.wait_ready()
        b.wait_ready()
        http = f"127.0.0.1:{free_port()}"
        g = "KSERVE_TRIO_GATEWAY_"
        gw = Gateway(work, {g + "WORKERS": f"{a.url},{b.url}", g + "LISTEN_HTTP": http})
        gw.http_url = http
        gw.wait_ready()
        region = weight_region(a, "mlp")
        assert weight_region(b, "mlp") == region  # one region for the node
        assert region in os.listdir(SHM_DIR)  # what the attacker sees
        yield a, b, gw, repo, region
    finally:
        if gw is not None:
            gw.stop()
        a.terminate()
        b.terminate()


def entry_points(node):
    a, b, gw, _, _ = node
    return {
        "grpc front end": grpcclient.InferenceServerClient(a.url),
        "rest front end": httpclient.InferenceServerClient(a.http_url),
        "grpc worker": grpcclient.InferenceServerClient(b.url),
        "rest worker": httpclient.InferenceServerClient(b.http_url),
        "grpc gateway": grpcclient.InferenceServerClient(gw.url),
        "rest gateway": httpclient.InferenceServerClient(gw.http_url),
    }


def refusal(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message() or ""


def assert_refused_by_the_rule(where: str, call) -> None:
    status, message = refusal(call)
    assert status in ("StatusCode.INVALID_ARGUMENT", "400"), (where, status, message)
    assert RESERVED_RULE in message, (where, message)


def attack(client, lib, key: str, lock: str, size: int) -> None:
    """What the attacker does through one entry point; every step must fail."""
    where = f"{lib.__name__} {key}"
    assert_refused_by_the_rule(
        where, lambda: client.register_system_shared_memory("evil", key, size)
    )
    assert_refused_by_the_rule(
        where, lambda: client.register_system_shared_memory("evil_in", key, 64, offset=64)
    )
    assert_refused_by_the_rule(where, lambda: client.register_system_shared_memory("lk", lock, 1))
    out = lib.InferRequestedOutput("probs")
    out.set_shared_memory("evil", 32, offset=64)  # mlp_softmax's probs over mlp's first tensor
    inp = lib.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    refusal(lambda: client.infer("mlp_softmax", [inp], outputs=[out]))
    stolen = lib.InferInput("input_0", [1, 16], "FP32")
    stolen.set_shared_memory("evil_in", 64)  # the weights read back as an input
    refusal(lambda: client.infer("mlp", [stolen]))
    regions = client.get_system_shared_memory_status()
    listed = regions if isinstance(regions, list) else list(regions.regions)
    assert listed == [], listed


def test_no_entry_point_registers_the_weight_region_and_every_answer_stays_right(node):
    a, b, gw, repo, region = node
    path = SHM_DIR / region
    before = path.read_bytes()
    key, lock = "/" + region, "/" + region + ".lock"
    assert (SHM_DIR / (region + ".lock")).exists()
    for name, client in entry_points(node).items():
        lib = grpcclient if name.startswith("grpc") else httpclient
        attack(client, lib, key, lock, len(before))
    alias = f"evil_{uuid.uuid4().hex[:8]}"
    os.link(path, SHM_DIR / alias)  # a name the prefix does not catch
    try:
        for url in (a.url, b.url, gw.url):
            status, message = refusal(
                lambda u=url: grpcclient.InferenceServerClient(u).register_system_shared_memory(
                    "evil", "/" + alias, 64
                )
            )
            assert status == "StatusCode.INVALID_ARGUMENT", (url, message)
            assert "is another name (a hard link) of a reserved object" in message
    finally:
        os.unlink(SHM_DIR / alias)
    assert path.read_bytes() == before
    weights = ref.weights(repo, "mlp")
    for worker in (a, b):
        c = grpcclient.InferenceServerClient(worker.url)
        inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
        inp.set_data_from_numpy(X)
        got = c.infer("mlp", [inp]).as_numpy("output")
        np.testing.assert_allclose(got, ref.mlp(X, weights), rtol=1e-5, atol=1e-5)
        probs = c.infer("mlp_softmax", [inp]).as_numpy("probs")
        np.testing.assert_allclose(probs, ref.softmax(ref.mlp(X, weights)), rtol=1e-5, atol=1e-6)


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def held_names(pid: int) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """What ``pid`` holds in ``/dev/shm`` (mapped or open), the permissions of each mapping,
    and the memfd names it maps."""
    names: set[str] = set()
    perms: dict[str, set[str]] = {}
    memfds: set[str] = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            target = fields[5].strip().removesuffix(" (deleted)") if len(fields) == 6 else ""
            if target.startswith("/dev/shm/"):
                name = target.removeprefix("/dev/shm/")
                names.add(name)
                perms.setdefault(name, set()).add(fields[1])
            elif target.startswith("/memfd:"):
                memfds.add(target.removeprefix("/memfd:"))
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            names.add(target.removeprefix("/dev/shm/"))
    return names, perms, memfds


def test_every_object_the_workers_hold_is_reserved_and_the_weights_are_mapped_read_only(node):
    a, b, _, _, region = node
    frontends = children(a.proc.pid)
    assert len(frontends) == 2, frontends
    for pid in (a.proc.pid, b.proc.pid, *frontends):
        names, perms, memfds = held_names(pid)
        assert all(n.startswith(RESERVED_PREFIX) for n in names), (pid, names)
        if pid in frontends:
            assert memfds and all(m.startswith(RESERVED_PREFIX) for m in memfds), memfds
            continue
        assert region in names and region + ".lock" in names, (pid, names)
        assert perms[region] == {"r--s"}, (pid, perms)
