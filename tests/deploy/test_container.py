"""The container recipes (deploy/container/), buildable by construction: every source they copy
exists and reaches the build context, the package builds from exactly those files, every
command parses with the CLI's own parser, every variable is one the configuration accepts,
the exposed ports are the node's public ports, and the image's entrypoint and healthcheck
really serve a model repository."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from kserve_trio.node._files import DEFAULT_NODE_FILE
from kserve_trio.node._plan import DEFAULT_LISTEN_GRPC, DEFAULT_LISTEN_METRICS, parse_listen
from tests.deploy import rules
from tests.deploy.manifests import (
    CONTAINER,
    DOCKERFILES,
    ROOT,
    ignore_patterns,
    is_ignored,
    parse_dockerfile,
    tracked_files,
)

VARIANTS = sorted(DOCKERFILES)
PUBLIC = (
    parse_listen(DEFAULT_LISTEN_GRPC, "grpc")[1],
    parse_listen(DEFAULT_LISTEN_METRICS, "m")[1],
)


def image_path(df, container_path: str) -> Path:
    """The checkout file the final stage COPYs to ``container_path``."""
    for sources, dest, stage in df.copies():
        if stage is None and dest == container_path and len(sources) == 1:
            return ROOT / sources[0]
    raise AssertionError(f"{df.path.name} puts nothing at {container_path}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_copy_sources_exist_and_reach_the_build_context(variant):
    df = parse_dockerfile(DOCKERFILES[variant])
    patterns = ignore_patterns(DOCKERFILES[variant].with_name(f"{variant}.Dockerfile.dockerignore"))
    copied = [
        s
        for i in range(len(df.stages))
        for sources, _, stage in df.copies(i)
        if stage is None
        for s in sources
    ]
    assert copied, "no COPY from the build context"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY source {source} is not in the repository"
        files = tracked_files(source)
        assert files, f"COPY source {source} holds no tracked file"
        kept = [f for f in files if not is_ignored(f, patterns)]
        assert kept == [f for f in files if "__pycache__" not in f], f"{source}: files ignored"
    for heavy in (".venv", ".venv-triton", ".venv-deploy", "models", "tests", ".git"):
        assert is_ignored(heavy, patterns), f"{heavy} would be sent to the builder"
    assert is_ignored("kserve_trio/__pycache__/x.pyc", patterns)


def test_the_ignore_rules_follow_dockers_last_match_wins():
    patterns = ["*", "!kserve_trio", "**/__pycache__"]
    assert is_ignored("README.md", patterns)
    assert not is_ignored("kserve_trio/node/cli.py", patterns)
    assert is_ignored("kserve_trio/node/__pycache__/cli.cpython-311.pyc", patterns)
    assert not is_ignored("README.md", [*patterns, "!README.md"])


def test_the_package_builds_from_exactly_the_copied_files(tmp_path):
    """The build stage's context (its COPY sources, less what the ignore file drops) builds a
    wheel holding every module of the package."""
    # The build stage installs from its WORKDIR, where its COPYs land.
    assert parse_dockerfile(DOCKERFILES["cpu"]).workdir(0) == "/src"
    df = parse_dockerfile(DOCKERFILES["cpu"])
    patterns = ignore_patterns(CONTAINER / "cpu.Dockerfile.dockerignore")
    context = tmp_path / "src"
    for sources, _, stage in df.copies(0):
        assert stage is None
        for source in sources:
            for f in tracked_files(source):
                if is_ignored(f, patterns):
                    continue
                target = context / f
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes((ROOT / f).read_bytes())
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("kserve_trio-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {f for f in tracked_files("kserve_trio") if "__pycache__" not in f}
    assert package <= names, sorted(package - names)[:10]


@pytest.mark.parametrize("variant", VARIANTS)
def test_entrypoint_and_healthcheck_parse_with_the_cli(variant):
    df = parse_dockerfile(DOCKERFILES[variant])
    entry = df.entry_argv()
    assert entry[0] == "/app/.venv/bin/python"
    venvs = [dest for sources, dest, stage in df.copies() if stage and sources == ["/app/.venv"]]
    assert venvs == ["/app/.venv"], "the interpreter's environment is not copied into the image"
    assert any("python -m venv /app/.venv" in r.args for r in df.all("RUN"))
    args = rules.parse_cli(rules.module_args(entry))
    assert args.command == "node"
    health = rules.parse_cli(rules.module_args(df.healthcheck_argv()))
    assert health.command == "probe"
    assert health.timeout == 5.0
    # The healthcheck's own timeout leaves room for the probe's.
    assert "--timeout=10s" in df.one("HEALTHCHECK").args


@pytest.mark.parametrize("variant", VARIANTS)
def test_environment_variables_are_ones_the_project_reads(variant):
    env = parse_dockerfile(DOCKERFILES[variant]).env()
    assert rules.unknown_env(env) == []
    assert env["KSERVE_TRIO_NODE_FILE"] == DEFAULT_NODE_FILE


def test_an_unknown_variable_is_caught():
    assert rules.unknown_env({"INFERENCE_SERVER_RUNTIME_BAKEND": "cuda"}) == [
        "INFERENCE_SERVER_RUNTIME_BAKEND"
    ]
    assert rules.unknown_env({"KSERVE_TRIO_GPU": "1", "KSERVE_TRIO_GATEWAY_LISTEN": "x"}) == [
        "KSERVE_TRIO_GPU",
        "KSERVE_TRIO_GATEWAY_LISTEN",
    ]
    assert rules.unknown_env({"KSERVE_TRIO_GPUS": "1", "PATH": "/bin"}) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_exposed_ports_are_the_public_ports_a_single_worker_serves(variant):
    df = parse_dockerfile(DOCKERFILES[variant])
    exposed = tuple(int(p) for ins in df.final("EXPOSE") for p in ins.args.split())
    assert exposed == PUBLIC == (8001, 8002)
    env = df.env()
    node = image_path(df, env["KSERVE_TRIO_NODE_FILE"])
    p = rules.plan(node, env, gpus=1)
    assert p.role == "all"
    assert [c.kind for c in p.children] == ["worker"]
    assert p.children[0].address == ("0.0.0.0", 8001)
    assert p.public_metrics == ("0.0.0.0", 8002)
    assert p.children[0].env["INFERENCE_SERVER_ENDPOINTS_METRICS_PORT"] == "8002"


def test_the_cuda_image_is_a_cuda_node_and_the_cpu_image_a_cpu_node():
    cpu, cuda = (parse_dockerfile(DOCKERFILES[v]) for v in ("cpu", "cuda"))
    node = image_path(cpu, cpu.env()["KSERVE_TRIO_NODE_FILE"])
    # The CUDA image: one worker per GPU nvidia-smi lists, the embedded gateway on the public
    # ports once there are two; the CPU image ignores the host's GPUs.
    two = rules.plan(node, cuda.env(), gpus=2)
    assert [(c.name, c.env["CUDA_VISIBLE_DEVICES"]) for c in two.workers] == [
        ("worker0", "0"),
        ("worker1", "1"),
    ]
    assert two.child("gateway").address == ("0.0.0.0", 8001)
    assert len(rules.plan(node, cpu.env(), gpus=2).workers) == 1
    with pytest.raises(Exception, match="no GPUs detected for a CUDA node"):
        rules.plan(node, cuda.env(), gpus=0)
    # The cuda extra is what brings jax's CUDA 12 wheels.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("jax[cuda12]") for dep in extras["cuda"])
    assert any('pip install ".[cuda]"' in r.args for r in cuda.all("RUN"))
    assert not any("[cuda]" in r.args for r in cpu.all("RUN"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_repository_mount_point_and_non_root_user(variant):
    df = parse_dockerfile(DOCKERFILES[variant])
    env = df.env()
    node = rules.plan(image_path(df, env["KSERVE_TRIO_NODE_FILE"]), env, gpus=1).node
    assert df.one("VOLUME").exec_form() == [node["model_repo"]] == ["/models"]
    user = df.one("USER").args
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0
    setup = " ".join(r.args for r in df.final("RUN"))
    assert f"--uid {uid}" in setup
    # The runtime directory the supervisor writes its node file to is the user's.
    assert env["KSERVE_TRIO_RUNTIME_DIR"] == "/run/kserve_trio"
    assert f"install -d -o {uid} -g {gid} /run/kserve_trio /models" in setup


def test_the_kserve_node_file_ships_in_both_images():
    for variant in VARIANTS:
        df = parse_dockerfile(DOCKERFILES[variant])
        kserve = image_path(df, "/etc/kserve_trio/kserve-node.yaml")
        assert kserve == CONTAINER / "kserve-node.yaml"
    p = rules.plan(
        CONTAINER / "kserve-node.yaml", parse_dockerfile(DOCKERFILES["cuda"]).env(), gpus=1
    )
    assert p.node["model_repo"] == "/mnt/models"
    assert p.children[0].address == ("0.0.0.0", 8001)


def test_image_tags_carry_the_project_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for variant, path in DOCKERFILES.items():
        assert f"-t kserve-trio:{version}-{variant} ." in path.read_text()


@pytest.mark.slow
def test_the_images_entrypoint_serves_and_its_healthcheck_passes(live_node):
    """The CPU image's ENTRYPOINT + CMD with its ENV: the healthcheck passes (the fixture waits
    for it), the admin port answers the probes the manifests use, and a stock client infers."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    assert live_node.run_healthcheck().stdout.startswith("ready: ")
    assert live_node.get("/readyz") == (200, "ok")
    assert live_node.get("/healthz") == (200, "ok")
    client = grpcclient.InferenceServerClient(live_node.grpc)
    x = np.ones((2, 16), np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    assert client.infer("mlp", [inp]).as_numpy("output").shape == (2, 8)
    assert "single worker: serving directly on" in live_node.logs()
