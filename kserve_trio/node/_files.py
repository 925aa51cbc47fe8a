"""The supervisor's files: where the node file comes from, where the materialized one goes.

Every child reads the same materialized node file (the node as planned: synthesized workers,
devices assigned), written once before any child starts, to ``runtime_dir/node.yaml``:
``runtime_dir`` is the keyword, else ``KSERVE_TRIO_RUNTIME_DIR``, else ``/run/kserve_trio`` when
it can be created and written, else a fresh temporary directory (removed when the node stops).
A node's ``gateway:`` block is written next to it as ``gateway.yaml`` for the embedded gateway.
Files are written to a temporary name and renamed, so a child never reads half a file.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import (
    ENV_OVERRIDES,
    load_node_raw,
    load_yaml_mapping,
    parse_env_value,
    with_upstream_aliases,
)
from kserve_trio.node._devices import Machine
from kserve_trio.node._plan import (
    GATEWAY_FILE_ENV,
    GatewaySource,
    NodePlan,
    plan_node,
    resolve_role,
)

NODE_FILE_ENV = "KSERVE_TRIO_NODE_FILE"
DEFAULT_NODE_FILE = "/etc/kserve_trio/node.yaml"
RUNTIME_DIR_ENV = "KSERVE_TRIO_RUNTIME_DIR"
DEFAULT_RUNTIME_DIR = "/run/kserve_trio"

ENV_OVERRIDES_BY_PATH: Mapping[str, str] = {path: var for var, path in ENV_OVERRIDES.items()}
"""A worker config key -> the environment variable that overrides it."""


def default_node_file(env: Mapping[str, str]) -> str:
    """``KSERVE_TRIO_NODE_FILE``, else ``/etc/kserve_trio/node.yaml``."""
    return env.get(NODE_FILE_ENV, "").strip() or DEFAULT_NODE_FILE


@dataclass(frozen=True)
class RuntimeDir:
    """The directory holding the materialized files; ``temporary`` ones are removed at exit."""

    path: Path
    temporary: bool = False

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)


def choose_runtime_dir(
    runtime_dir: str | os.PathLike[str] | None,
    env: Mapping[str, str],
    default: str = DEFAULT_RUNTIME_DIR,
) -> RuntimeDir:
    """The keyword, else ``KSERVE_TRIO_RUNTIME_DIR`` (either must be creatable), else
    ``default`` when writable, else a new temporary directory."""
    explicit = runtime_dir if runtime_dir is not None else env.get(RUNTIME_DIR_ENV, "").strip()
    if explicit:
        path = Path(explicit)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the node runtime directory {path}: {exc}") from None
        if not os.access(path, os.W_OK):
            raise ConfigError(f"the node runtime directory {path} is not writable")
        return RuntimeDir(path)
    try:
        Path(default).mkdir(parents=True, exist_ok=True)
        if os.access(default, os.W_OK):
            return RuntimeDir(Path(default))
    except OSError:
        pass
    return RuntimeDir(Path(tempfile.mkdtemp(prefix="kserve_trio-node-")), temporary=True)


def write_yaml(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as YAML atomically (temporary file in the same directory, then rename)."""
    yaml = YAML(typ="safe")
    yaml.default_flow_style = False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.dump(_plain(data), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def read_gateway_source(
    gateway_path: str | os.PathLike[str] | None,
    env: Mapping[str, str],
    node: Mapping[str, Any] | None,
    block_file: Path,
) -> GatewaySource:
    """``--gateway FILE``, else ``KSERVE_TRIO_GATEWAY_FILE`` (either must exist), else the
    node's ``gateway:`` block (to be written to ``block_file``), else environment only."""
    path: str | None = None
    if gateway_path is not None:
        path = os.fspath(gateway_path)
    elif env.get(GATEWAY_FILE_ENV, "").strip():
        path = env[GATEWAY_FILE_ENV].strip()
    if path is not None:
        return GatewaySource(
            "file", str(Path(path).resolve()), load_yaml_mapping(path, "gateway config")
        )
    block = (node or {}).get("gateway")
    if isinstance(block, Mapping):
        return GatewaySource("node", str(block_file), dict(block))
    return GatewaySource()


def load_node_for_role(
    node_path: str | os.PathLike[str] | None, role: str | None, env: Mapping[str, str]
) -> tuple[dict[str, Any] | None, str]:
    """The raw node file and the resolved role. A gateway-only node needs no node file: a
    missing one is ``None`` there and an error for the other roles."""
    path = node_path if node_path is not None else default_node_file(env)
    try:
        node: dict[str, Any] | None = load_node_raw(path)
    except ConfigError:
        if resolve_role(role, env, None) == "gateway" and not Path(path).exists():
            return None, "gateway"
        raise
    return node, resolve_role(role, env, node)


def check_model_repo(plan: NodePlan, env: Mapping[str, str] | None = None) -> None:
    """A plan that starts workers needs its workers' model repositories to be directories now:
    a node file naming one that does not exist is a configuration error before any child
    starts, not a crash loop of workers that each fail to load it. The workers read
    ``INFERENCE_SERVER_MODEL_DIRS`` over the node's ``model_repo`` when it is set (``env``), so
    those are the directories checked then."""
    if plan.node is None or not any(c.kind == "worker" for c in plan.children):
        return
    override = with_upstream_aliases(env or {}).get(ENV_OVERRIDES_BY_PATH["model_dirs"])
    if override is not None:
        missing = [
            d for d in parse_env_value("", override, "model_dirs", "list") if not Path(d).is_dir()
        ]
        if missing:
            raise ConfigError(
                f"{ENV_OVERRIDES_BY_PATH['model_dirs']} names {missing[0]!r}, not a directory",
                "model_dirs",
            )
        return
    repo = plan.node.get("model_repo")
    if isinstance(repo, str) and repo and not Path(repo).is_dir():
        raise ConfigError(f"node config 'model_repo' {repo!r} is not a directory", "model_repo")


def prepare_node(
    node_path: str | os.PathLike[str] | None,
    *,
    role: str | None,
    gateway_path: str | os.PathLike[str] | None,
    env: Mapping[str, str],
    runtime_dir: str | os.PathLike[str] | None = None,
    machine: Machine | None = None,
    python: str = sys.executable,
    write: bool = True,
) -> tuple[NodePlan, RuntimeDir | None]:
    """Read, plan and (``write=True``) write the node's files; the runtime directory is
    ``None`` when nothing needs writing (``write=False``, as the readiness probe plans).
    Upstream ``REACTANT_*`` names are read as their new names (``core.process.upstream_env``)."""
    env = with_upstream_aliases(env)
    node, role = load_node_for_role(node_path, role, env)
    rdir = choose_runtime_dir(runtime_dir, env) if write else None
    base = rdir.path if rdir is not None else Path(tempfile.gettempdir())
    try:
        source = None
        if role in ("all", "gateway"):
            source = read_gateway_source(gateway_path, env, node, base / "gateway.yaml")
        plan = plan_node(
            node,
            role=role,
            env=env,
            machine=machine or Machine.system(),
            node_file=str(base / "node.yaml"),
            gateway=source,
            python=python,
        )
        if rdir is not None:
            if plan.node is not None and plan.node_file:
                write_yaml(Path(plan.node_file), plan.node)
            if plan.gateway_block is not None and plan.gateway_file:
                write_yaml(Path(plan.gateway_file), plan.gateway_block)
    except BaseException:
        if rdir is not None:
            rdir.cleanup()
        raise
    return plan, rdir


__all__ = [
    "DEFAULT_NODE_FILE",
    "DEFAULT_RUNTIME_DIR",
    "NODE_FILE_ENV",
    "RUNTIME_DIR_ENV",
    "RuntimeDir",
    "check_model_repo",
    "choose_runtime_dir",
    "default_node_file",
    "load_node_for_role",
    "prepare_node",
    "read_gateway_source",
    "write_yaml",
]
