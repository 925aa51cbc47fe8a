"""The kustomize fleet (deploy/k8s/): rendered offline with ``kubectl kustomize``, every object
schema-checked, and every command, variable, port, probe, mount and discovery name held
against what the node supervisor, the worker and the gateway configuration really do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kserve_trio.core.process.node import worker_raw_config
from kserve_trio.gateway.config import load_gateway_config
from kserve_trio.gateway.fleet.routing import make_policy
from kserve_trio.node._probe import probe_targets
from tests.deploy import rules
from tests.deploy.manifests import (
    CONTAINER,
    DEPLOY,
    container_env,
    dockerfile_for_image,
    find,
    load_yaml_file,
    mount_for,
    mounted_files,
    parse_dockerfile,
    pod_labels,
    pod_spec,
    port_numbers,
    resolve_port,
)

OVERLAYS = ("base", "cpu")
EXAMPLES = sorted((DEPLOY / "k8s" / "examples").glob("*.yaml"))


def test_every_manifest_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 20
    for path in files:
        docs = load_yaml_file(path)
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_the_kustomizations_render(rendered):
    kinds = sorted(o["kind"] for o in rendered["base"])
    assert kinds == sorted(
        ["ConfigMap", "ConfigMap", "PersistentVolumeClaim", "Service", "Service", "StatefulSet",
         "PodDisruptionBudget", "PodDisruptionBudget", "Deployment"]
    )  # fmt: skip
    assert sorted(o["kind"] for o in rendered["cpu"]) == kinds
    assert [o["kind"] for o in rendered["monitoring"]] == ["ConfigMap", "ConfigMap"]


def test_rendered_objects_pass_the_schemas(rendered, checker):
    objects = [o for name in rendered for o in rendered[name]]
    objects += [o for path in EXAMPLES for o in load_yaml_file(path)]
    assert checker(objects)["schema"] == []


def test_the_schema_check_rejects_a_bad_object(rendered, checker):
    (sts,) = find(rendered["base"], "StatefulSet")
    bad = {**sts, "spec": {**sts["spec"], "replica": 2}}
    wrong = {**sts, "spec": {**sts["spec"], "replicas": "two"}}
    errors = checker([bad, wrong])["schema"]
    assert [i for i, _ in errors] == [0, 1]
    assert "'replica' was unexpected" in errors[0][1]


# ---------------------------------------------------------------------------------------------
# Planning a pod's container the way the supervisor will


class Pod:
    """A workload's one container, its image, and the files its mounts and image provide."""

    def __init__(self, objects, obj, tmp: Path) -> None:
        self.obj = obj
        self.spec = pod_spec(obj)
        (self.container,) = self.spec["containers"]
        self.dockerfile = parse_dockerfile(dockerfile_for_image(self.container["image"]))
        self.argv = self.dockerfile.entry_argv(self.container.get("args"))
        self.args = rules.parse_cli(rules.module_args(self.argv))
        self.env = {**self.dockerfile.env(), **container_env(self.container)}
        # Container path -> a file on this machine holding what the pod sees there.
        self.files: dict[str, str] = {}
        for sources, dest, stage in self.dockerfile.copies():
            if stage is None:
                self.files[dest] = str(CONTAINER.parents[1] / sources[0])
        for i, (path, text) in enumerate(mounted_files(self.spec, self.container, objects).items()):
            local = tmp / f"mount{i}-{Path(path).name}"
            local.write_text(text)
            self.files[path] = str(local)

    def local_env(self) -> dict[str, str]:
        return {k: self.files.get(v, v) for k, v in self.env.items()}

    def gpus(self) -> int:
        return int(self.container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))

    def plan(self, args=None):
        args = args or self.args
        node = self.files.get(args.node, args.node) if args.node else None
        gateway = getattr(args, "gateway", None)
        return rules.plan(
            node,
            self.local_env(),
            role=getattr(args, "role", None),
            gateway_path=self.files.get(gateway, gateway) if gateway else None,
            gpus=self.gpus(),
        )

    def ports(self, prefix: str) -> list[int]:
        named = port_numbers(self.container)
        return [p for n, p in named.items() if re.fullmatch(rf"{prefix}(-[0-9]+)?", n)]


def workload(rendered, overlay: str, kind: str, tmp_path) -> Pod:
    objects = rendered[overlay]
    (obj,) = find(objects, kind)
    return Pod(objects, obj, tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_run_the_supervisor_in_role_workers_on_their_declared_ports(
    rendered, overlay, tmp_path
):
    pod = workload(rendered, overlay, "StatefulSet", tmp_path)
    assert pod.args.command == "node"
    assert rules.unknown_env(pod.env) == []
    plan = pod.plan()
    assert plan.role == "workers"
    # One worker per GPU the pod is given (KSERVE_TRIO_GPUS matches the resource limit), or
    # one CPU worker.
    assert int(pod.env["KSERVE_TRIO_GPUS"]) == pod.gpus()
    assert len(plan.workers) == max(pod.gpus(), 1)
    assert [c.kind for c in plan.children] == ["worker"] * len(plan.workers)
    assert [w.address for w in plan.workers] == [("0.0.0.0", p) for p in pod.ports("grpc")]
    metrics = [
        worker_raw_config(plan.node, w.name)["endpoints"]["metrics_port"] for w in plan.workers
    ]
    assert metrics == pod.ports("metrics")
    backend = "cuda" if pod.gpus() else "cpu"
    assert pod.env.get("INFERENCE_SERVER_RUNTIME_BACKEND", "cpu") == backend


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_probes_ask_what_the_supervisor_serves(rendered, overlay, tmp_path):
    pod = workload(rendered, overlay, "StatefulSet", tmp_path)
    c = pod.container
    supervisor = pod.plan()
    probe_argv = c["readinessProbe"]["exec"]["command"]
    probe_args = rules.parse_cli(rules.module_args(probe_argv))
    assert probe_args.command == "probe"
    assert probe_args.timeout < c["readinessProbe"]["timeoutSeconds"]
    # The probe plans the node from the same environment: same role, every worker asked.
    probed = pod.plan(probe_args)
    assert probed.role == supervisor.role
    assert probe_targets(probed, None) == [("127.0.0.1", p) for p in pod.ports("grpc")]
    for name in ("startupProbe", "livenessProbe"):
        get = c[name]["httpGet"]
        assert rules.admin_path_ok(get["path"])
        assert resolve_port(c, get["port"]) in pod.ports("metrics")
    annotations = pod.obj["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) in pod.ports("metrics")
    assert rules.admin_path_ok(annotations["prometheus.io/path"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_mounts_models_shared_memory_and_scratch(rendered, overlay, tmp_path):
    pod = workload(rendered, overlay, "StatefulSet", tmp_path)
    c, volumes = pod.container, {v["name"]: v for v in pod.spec["volumes"]}
    plan = pod.plan()
    models = mount_for(c, plan.node["model_repo"])
    assert models is not None and models["readOnly"] is True
    claim = volumes[models["name"]]["persistentVolumeClaim"]["claimName"]
    assert find(rendered[overlay], "PersistentVolumeClaim", claim)
    shm = mount_for(c, "/dev/shm")
    assert shm["mountPath"] == "/dev/shm"
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    run = mount_for(c, pod.env["KSERVE_TRIO_RUNTIME_DIR"])
    assert "emptyDir" in volumes[run["name"]]
    uid = int(pod.dockerfile.one("USER").args.split(":")[0])
    assert pod.spec["securityContext"]["runAsUser"] == uid


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_discovers_every_worker_through_the_headless_service(
    rendered, overlay, tmp_path
):
    objects = rendered[overlay]
    (tmp_path / "w").mkdir()
    (tmp_path / "g").mkdir()
    workers = workload(rendered, overlay, "StatefulSet", tmp_path / "w")
    gateway = workload(rendered, overlay, "Deployment", tmp_path / "g")
    assert gateway.args.command == "node"
    assert rules.unknown_env(gateway.env) == []
    plan = gateway.plan()
    assert plan.role == "gateway"
    assert [c.kind for c in plan.children] == ["gateway"]
    child = plan.child("gateway")
    assert rules.module_args(child.argv) == ["gateway"]
    cfg = load_gateway_config(env=child.env, check_files=False).config
    assert cfg.prober.startup_wait_seconds == float("inf")
    assert cfg.listen.grpc_address[1] in gateway.ports("grpc")
    assert cfg.listen.metrics_address[1] in gateway.ports("admin")
    # One endpoint per worker index, each the headless Service's name and that worker's port.
    service = workers.obj["spec"]["serviceName"]
    (headless,) = find(objects, "Service", service)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    worker_ports = [w.address[1] for w in workers.plan().workers]
    assert list(cfg.endpoints) == [f"{service}:{p}" for p in worker_ports]
    # The dashboards' replica-load panel needs a policy with load counters.
    assert make_policy(cfg.scheduling).basis is not None
    # Readiness and liveness on the gateway's admin port.
    for name, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = gateway.container[name]["httpGet"]
        assert get["path"] == path and rules.admin_path_ok(path)
        assert resolve_port(gateway.container, get["port"]) == cfg.listen.metrics_address[1]
    # The image's healthcheck, run in this container, asks the gateway's public port.
    probed = gateway.plan(rules.parse_cli(["probe"]))
    assert probe_targets(probed, None) == [("127.0.0.1", cfg.listen.grpc_address[1])]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_budgets_select_their_pods(rendered, overlay):
    objects = rendered[overlay]
    workloads = find(objects, "StatefulSet") + find(objects, "Deployment")
    for svc in find(objects, "Service"):
        selector = svc["spec"]["selector"]
        targets = [w for w in workloads if selector.items() <= pod_labels(w).items()]
        assert len(targets) == 1, svc["metadata"]["name"]
        target = targets[0]
        (c,) = pod_spec(target)["containers"]
        for port in svc["spec"]["ports"]:
            assert resolve_port(c, port["targetPort"]) == port["port"], port
    for pdb in find(objects, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [w for w in workloads if selector.items() <= pod_labels(w).items()]
        assert len(matched) == 1, pdb["metadata"]["name"]
    (sts,) = find(objects, "StatefulSet")
    assert sts["spec"]["selector"]["matchLabels"].items() <= pod_labels(sts).items()


def test_the_cpu_overlay_is_a_cpu_fleet(rendered, tmp_path):
    pod = workload(rendered, "cpu", "StatefulSet", tmp_path)
    assert pod.gpus() == 0
    assert pod.dockerfile.path.name == "cpu.Dockerfile"
    assert "affinity" not in pod.spec
    (pvc,) = find(rendered["cpu"], "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_the_demo_models_job_writes_the_repository_the_workers_serve(rendered, tmp_path):
    (job,) = [o for path in EXAMPLES for o in load_yaml_file(path) if o["kind"] == "Job"]
    (c,) = pod_spec(job)["containers"]
    argv = parse_dockerfile(dockerfile_for_image(c["image"])).entry_argv(c["args"])
    args = rules.parse_cli(rules.module_args(argv))
    assert args.command == "bundle"
    assert (
        str(args.dir)
        == workload(rendered, "base", "StatefulSet", tmp_path).plan().node["model_repo"]
    )
    mount = mount_for(c, str(args.dir))
    (volume,) = [v for v in pod_spec(job)["volumes"] if v["name"] == mount["name"]]
    assert find(
        rendered["base"], "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
    )


@pytest.mark.slow
def test_the_fleet_gateway_routes_through_the_headless_service_name(live_gateway):
    """The gateway Deployment's container (role gateway, the base's gateway.yaml, the name
    kserve-trio-workers resolving to the live worker): its healthcheck passes, its probes
    answer, /routing lists the worker's model, and a stock client infers through it."""
    import json

    import numpy as np
    import tritonclient.grpc as grpcclient

    health = live_gateway.run_healthcheck()
    assert health.returncode == 0 and health.stdout.startswith("ready: ")
    assert live_gateway.get("/readyz") == (200, "ok")
    assert live_gateway.get("/healthz") == (200, "ok")
    status, body = live_gateway.get("/routing")
    assert status == 200 and json.loads(body)["models"] == {"mlp": ["gpu0"]}
    client = grpcclient.InferenceServerClient(live_gateway.grpc)
    inp = grpcclient.InferInput("input_0", [4, 16], "FP32")
    inp.set_data_from_numpy(np.ones((4, 16), np.float32))
    assert client.infer("mlp", [inp]).as_numpy("output").shape == (4, 8)
    assert "role=gateway children=gateway" in live_gateway.logs()
