"""The KServe manifests (deploy/kserve/): schema-checked with the kserve SDK's models, and the
runtime's command, ports, probes, shared memory and model mount held against what the image
and the node supervisor really do."""

from __future__ import annotations

from tests.deploy import rules
from tests.deploy.manifests import (
    CONTAINER,
    DEPLOY,
    container_env,
    dockerfile_for_image,
    find,
    load_yaml_file,
    mount_for,
    parse_dockerfile,
    resolve_port,
)

RUNTIME = load_yaml_file(DEPLOY / "kserve" / "clusterservingruntime.yaml")
ISVC = load_yaml_file(DEPLOY / "kserve" / "inferenceservice.yaml")


def runtime() -> dict:
    (rt,) = find(RUNTIME, "ClusterServingRuntime")
    return rt


def container() -> dict:
    (c,) = runtime()["spec"]["containers"]
    return c


def test_manifests_pass_the_kserve_sdk_models(checker):
    result = checker([*RUNTIME, *ISVC])
    assert result["schema"] == []


def test_the_sdk_check_rejects_what_kserve_would(checker):
    rt = runtime()
    bad_field = {**rt, "spec": {**rt["spec"], "protocolVersion": ["grpc-v2"]}}
    bad_type = {**rt, "spec": {**rt["spec"], "multiModel": "no"}}
    result = checker([bad_field, bad_type])
    assert [i for i, _ in result["schema"]] == [0, 1]
    assert "unknown field 'protocolVersion'" in result["schema"][0][1]
    assert "expected bool" in result["schema"][1][1]


def test_runtime_format_protocol_and_one_grpc_port():
    spec = runtime()["spec"]
    assert [f["name"] for f in spec["supportedModelFormats"]] == ["stablehlo-bundle"]
    assert spec["protocolVersions"] == ["grpc-v2"]
    ports = container()["ports"]
    assert len(ports) == 1
    assert ports[0]["name"] == "h2c"


def plan_runtime():
    c = container()
    df = parse_dockerfile(dockerfile_for_image(c["image"]))
    assert df.path.name == "cuda.Dockerfile"
    argv = df.entry_argv(c["args"])
    args = rules.parse_cli(rules.module_args(argv))
    assert args.command == "node"
    env = {**df.env(), **container_env(c)}
    assert rules.unknown_env(env) == []
    # The node file named on the command line is the one the image ships.
    assert args.node == "/etc/kserve_trio/kserve-node.yaml"
    assert any(
        dest == args.node and sources == ["deploy/container/kserve-node.yaml"]
        for sources, dest, _ in df.copies()
    )
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    return rules.plan(CONTAINER / "kserve-node.yaml", env, role=args.role, gpus=gpus), env


def test_the_runtime_serves_its_port_and_probes_its_admin_port():
    p, env = plan_runtime()
    c = container()
    assert env["INFERENCE_SERVER_RUNTIME_BACKEND"] == "cuda"
    # One GPU: one worker serving the public ports itself.
    assert [w.address for w in p.workers] == [("0.0.0.0", c["ports"][0]["containerPort"])]
    assert p.public_grpc[1] == 8001
    assert p.public_metrics[1] == 8002
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and rules.admin_path_ok(path)
        assert resolve_port(c, get["port"]) == p.public_metrics[1]
    annotations = runtime()["spec"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == p.public_metrics[1]
    assert rules.admin_path_ok(annotations["prometheus.kserve.io/path"])


def test_storage_initializer_mount_shared_memory_and_gpu():
    p, env = plan_runtime()
    # KServe's storage initializer puts the storageUri's content at /mnt/models.
    assert p.node["model_repo"] == "/mnt/models"
    c = container()
    spec = runtime()["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = mount_for(c, "/dev/shm")
    assert shm is not None and shm["mountPath"] == "/dev/shm"
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    # The supervisor's runtime directory is writable scratch.
    run = mount_for(c, env["KSERVE_TRIO_RUNTIME_DIR"])
    assert run is not None and "emptyDir" in volumes[run["name"]]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["securityContext"]["runAsUser"] == int(
        parse_dockerfile(dockerfile_for_image(c["image"])).one("USER").args.split(":")[0]
    )


def test_the_inference_service_uses_the_runtime_in_raw_deployment_mode(rendered):
    (isvc,) = find(ISVC, "InferenceService")
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime()["metadata"]["name"]
    assert model["modelFormat"]["name"] in [
        f["name"] for f in runtime()["spec"]["supportedModelFormats"]
    ]
    assert model["protocolVersion"] in runtime()["spec"]["protocolVersions"]
    # storageUri: a model repository on the fleet's models volume.
    scheme, _, rest = model["storageUri"].partition("://")
    claim, _, path = rest.partition("/")
    assert scheme == "pvc"
    assert find(rendered["base"], "PersistentVolumeClaim", claim)
    assert path == "demo"
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
