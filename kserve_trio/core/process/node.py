"""Node files (``node.yaml``): one machine's workers, and the resolution of one worker's config.

A node file names the shared model repository, the port plan (``base_port`` + index, or a
worker's ``port:``; ``metrics_base_port`` + index; ``http_base_port`` + index for the REST
ports), a ``global:`` config block deep-merged into
every worker, the ``workers:`` list (each entry may carry its own override blocks) and an
optional ``models:`` map pinning models to device memory on the listed workers. Every worker
reads the same file and resolves its own raw config here; ``load_server_config`` then layers
the environment and the command line over it and builds and validates it with
``kserve_trio.core.process.config`` (which sits below this module and never imports it).

The supervisor also uses this module before validation: ``node_gpus`` parses the ``gpus:`` key
and ``materialize_node`` synthesizes or device-assigns the ``workers:`` list.

Keys the node derives for each worker (``model_dirs``, ``endpoints.port``,
``endpoints.metrics_port``, ``endpoints.http_port``, ``runtime.device_ordinal``) are rejected in ``global:`` and worker
blocks: a value there would be silently overwritten, i.e. inert.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Literal

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import get_logger
from kserve_trio.core.plain import is_int
from kserve_trio.core.process.config import (
    WORKER_NAME_ENV,
    ServerConfig,
    apply_env_overrides,
    build_config,
    check_keys,
    deep_merge,
    load_yaml_mapping,
    merge_given,
    validate_config,
)
from kserve_trio.core.process.upstream_env import with_upstream_aliases

NODE_KEYS = (
    "model_repo",
    "base_port",
    "metrics_base_port",
    "http_base_port",
    "gpus",
    "global",
    "workers",
    "models",
    "shared_host_weights",
    "role",
    "gateway",
)
ROLES = ("all", "workers", "gateway")
WORKER_RESERVED = ("name", "gpu", "host", "port")
"""Worker-entry keys with structural meaning; every other key is a config override block."""

_DERIVED = {
    "model_dirs": "it is the node's model_repo",
    "endpoints.port": "set the node's base_port or the worker's port",
    "endpoints.metrics_port": "set the node's metrics_base_port",
    "endpoints.http_port": "set the node's http_base_port",
    "runtime.device_ordinal": "set the worker's gpu",
}

_log = get_logger(__name__)


def load_node_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a node file without structural validation (the supervisor materializes first)."""
    return load_yaml_mapping(path, "node config")


def load_node(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and structurally validate a node file."""
    node = load_node_raw(path)
    validate_node(node)
    return node


def _workers(node: Mapping[str, Any]) -> list[MutableMapping[str, Any]]:
    workers = node.get("workers")
    if not isinstance(workers, list):
        raise ConfigError("node config 'workers' must be a list", "workers")
    if not workers:
        raise ConfigError("node config 'workers' must list at least one worker", "workers")
    for i, w in enumerate(workers):
        if not isinstance(w, MutableMapping):
            raise ConfigError("each node 'workers' entry must be a mapping", f"workers[{i}]")
    return workers


def _name(w: Mapping[str, Any], index: int) -> str:
    name = w.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            "each node worker must have a non-empty string 'name'", f"workers[{index}]"
        )
    return name


def worker_names(node: Mapping[str, Any]) -> list[str]:
    """The worker names in declaration order."""
    return [_name(w, i) for i, w in enumerate(_workers(node))]


def _int_key(node: Mapping[str, Any], key: str) -> int:
    value = node.get(key)
    if not is_int(value):
        raise ConfigError(f"node config '{key}' must be an integer", key)
    return value


def _port(node: Mapping[str, Any], w: Mapping[str, Any], index: int) -> int:
    if "port" in w:
        if not is_int(w["port"]):
            raise ConfigError(
                f"node worker '{_name(w, index)}' port must be an integer", f"workers[{index}].port"
            )
        return w["port"]
    return _int_key(node, "base_port") + index


def _metrics_port(node: Mapping[str, Any], index: int) -> int | None:
    if "metrics_base_port" not in node:
        return None
    return _int_key(node, "metrics_base_port") + index


def _http_port(node: Mapping[str, Any], index: int) -> int | None:
    if "http_base_port" not in node:
        return None
    return _int_key(node, "http_base_port") + index


def _assignments(node: Mapping[str, Any]) -> dict[str, list[str]]:
    models = node.get("models")
    if models is None:
        return {}
    if not isinstance(models, Mapping):
        raise ConfigError(
            "node config 'models' must be a mapping of model name to worker list", "models"
        )
    out: dict[str, list[str]] = {}
    for model, targets in models.items():
        path = f"models.{model}"
        if not isinstance(targets, list):
            raise ConfigError(f"node config '{path}' must be a list of worker names", path)
        if not targets:
            raise ConfigError(f"node config '{path}' assigns the model to no workers", path)
        if not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"node config '{path}' entries must be worker names (strings)", path)
        out[str(model)] = list(targets)
    return out


def _check_block(block: Any, prefix: str) -> None:
    """Unknown, removed and node-derived keys in a ``global:`` or worker override block."""
    if not isinstance(block, Mapping):
        raise ConfigError(f"node config '{prefix}' must be a mapping", prefix)
    check_keys(block, prefix)
    for rel, why in _DERIVED.items():
        head, _, leaf = rel.rpartition(".")
        holder = block.get(head) if head else block
        if isinstance(holder, Mapping) and leaf in holder:
            raise ConfigError(f"is derived by the node; {why}", f"{prefix}.{rel}")


def validate_node(node: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Structural validation of a parsed node file; returns ``node``.

    Rules:
    1. only the known top-level keys; ``model_repo`` a non-empty string; ``role`` one of
       all|workers|gateway; ``shared_host_weights`` a boolean; ``gpus`` parses (``node_gpus``);
    2. ``global`` and every worker's override blocks hold only config keys, and none of the
       keys the node derives (paths name where the key was written);
    3. ``workers`` a non-empty list of mappings with unique string names, integer ``gpu >= 0``,
       string ``host``, ports in 0..65535; no two workers bind the same non-zero gRPC port, and
       no metrics or HTTP port collides with any gRPC, metrics or HTTP port;
    4. ``models.X`` a non-empty list naming defined workers;
    5. each worker's resolved block builds (types and enums), before any env is applied.
    """
    for key in node:
        if key not in NODE_KEYS:
            raise ConfigError(f"unknown node config key (known: {', '.join(NODE_KEYS)})", str(key))
    repo = node.get("model_repo")
    if not isinstance(repo, str) or not repo:
        raise ConfigError("node config 'model_repo' must be a non-empty string", "model_repo")
    role = node.get("role", "all")
    if not isinstance(role, str) or role.strip().lower() not in ROLES:
        raise ConfigError(
            f"node config 'role' must be one of {', '.join(ROLES)} (got {role!r})", "role"
        )
    if "shared_host_weights" in node and not isinstance(node["shared_host_weights"], bool):
        raise ConfigError(
            "node config 'shared_host_weights' must be a boolean", "shared_host_weights"
        )
    gateway = node.get("gateway")
    if gateway is not None and not isinstance(gateway, Mapping):
        raise ConfigError("node config 'gateway' must be a mapping", "gateway")
    node_gpus(node)
    if node.get("global") is not None:
        _check_block(node["global"], "global")

    names: list[str] = []
    ports: dict[int, str] = {}
    for i, w in enumerate(_workers(node)):
        name = _name(w, i)
        if name in names:
            raise ConfigError(f"duplicate node worker name '{name}'", f"workers[{i}].name")
        names.append(name)
        if "gpu" in w and not (is_int(w["gpu"]) and w["gpu"] >= 0):
            raise ConfigError(
                f"node worker '{name}' gpu must be a non-negative integer", f"workers[{i}].gpu"
            )
        if "host" in w and not isinstance(w["host"], str):
            raise ConfigError(f"node worker '{name}' host must be a string", f"workers[{i}].host")
        overrides = {k: v for k, v in w.items() if k not in WORKER_RESERVED}
        _check_block(overrides, f"workers[{i}]")
        if "host" in w and isinstance(overrides.get("endpoints"), Mapping):
            if "host" in overrides["endpoints"]:
                raise ConfigError(
                    f"node worker '{name}' sets both 'host' and 'endpoints.host'; keep one",
                    f"workers[{i}].host",
                )
        port = _port(node, w, i)
        if not 0 <= port <= 65535:
            raise ConfigError(
                f"node worker '{name}' port {port} is out of range 0..65535", f"workers[{i}]"
            )
        if port and port in ports:
            other = ports[port]
            message = (
                f"node worker '{name}' port {port} collides with '{other}'"
                if other.endswith((" (metrics)", " (http)"))
                else f"node workers '{other}' and '{name}' both bind port {port}"
            )
            raise ConfigError(message, f"workers[{i}]")
        if port:
            ports[port] = name
        mport = _metrics_port(node, i)
        if mport is not None:
            if not 1 <= mport <= 65535:
                raise ConfigError(
                    f"node worker '{name}' metrics port {mport} is out of range 1..65535",
                    "metrics_base_port",
                )
            if mport in ports:
                raise ConfigError(
                    f"node worker '{name}' metrics port {mport} collides with '{ports[mport]}'",
                    "metrics_base_port",
                )
            ports[mport] = f"{name} (metrics)"
        hport = _http_port(node, i)
        if hport is not None:
            if not 1 <= hport <= 65535:
                raise ConfigError(
                    f"node worker '{name}' HTTP port {hport} is out of range 1..65535",
                    "http_base_port",
                )
            if hport in ports:
                raise ConfigError(
                    f"node worker '{name}' HTTP port {hport} collides with '{ports[hport]}'",
                    "http_base_port",
                )
            ports[hport] = f"{name} (http)"

    for model, targets in _assignments(node).items():
        for t in targets:
            if t not in names:
                raise ConfigError(
                    f"node config 'models.{model}' targets undefined worker '{t}' "
                    f"(have: {', '.join(names)})",
                    f"models.{model}",
                )
    for name in names:
        try:
            build_config(worker_raw_config(node, name))
        except ConfigError as exc:
            raise ConfigError(f"node worker '{name}': {exc.message}", exc.path) from None
    return node


def worker_raw_config(node: Mapping[str, Any], name: str) -> dict[str, Any]:
    """One worker's raw config (YAML shape, what ``build_config`` consumes).

    Rules, in order:
    1. start from a deep copy of ``global``; deep-merge the worker's override blocks (every key
       but name/gpu/host/port): mappings merge recursively, other values replace;
    2. ``model_dirs = [model_repo]``; ``endpoints.port`` = the worker's ``port`` or
       ``base_port + index``; ``endpoints.metrics_port = metrics_base_port + index`` and
       ``endpoints.http_port = http_base_port + index`` when set;
       ``endpoints.host`` = the worker's ``host`` when set; ``runtime.device_ordinal = gpu``
       (0 without one);
    3. the node-level ``shared_host_weights`` fills ``runtime.shared_host_weights`` unless set;
    4. each ``models:`` entry listing this worker sets ``scheduler.models.<m>.residency:
       device`` unless that model's block already has a ``residency``; other fields stay.
    """
    workers = _workers(node)
    names = [_name(w, i) for i, w in enumerate(workers)]
    if name not in names:
        raise ConfigError(f"worker '{name}' not defined in node (have: {', '.join(names)})")
    index = names.index(name)
    w = workers[index]
    glob = node.get("global") or {}
    if not isinstance(glob, Mapping):
        raise ConfigError("node config 'global' must be a mapping", "global")
    raw = deep_merge(glob, {k: v for k, v in w.items() if k not in WORKER_RESERVED})

    raw["model_dirs"] = [node.get("model_repo")]
    endpoints = _sub(raw, "endpoints")
    endpoints["port"] = _port(node, w, index)
    mport = _metrics_port(node, index)
    if mport is not None:
        endpoints["metrics_port"] = mport
    hport = _http_port(node, index)
    if hport is not None:
        endpoints["http_port"] = hport
    if "host" in w:
        endpoints["host"] = w["host"]
    runtime = _sub(raw, "runtime")
    runtime["device_ordinal"] = w.get("gpu", 0)
    if "shared_host_weights" in node:
        runtime.setdefault("shared_host_weights", node["shared_host_weights"])

    pinned = [m for m, targets in _assignments(node).items() if name in targets]
    if pinned:
        models = _sub(_sub(raw, "scheduler"), "models")
        for m in pinned:
            block = models.get(m)
            if block is None:
                block = models[m] = {}
            elif not isinstance(block, dict):
                raise ConfigError(
                    f"config 'scheduler.models.{m}' must be a mapping", f"scheduler.models.{m}"
                )
            block.setdefault("residency", "device")
    return raw


def _sub(raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        value = raw[key] = {}
    if not isinstance(value, dict):
        raise ConfigError(f"config '{key}' must be a mapping", key)
    return value


def choose_worker(
    node: Mapping[str, Any], worker: str | None, env: Mapping[str, str] = os.environ
) -> tuple[str, bool]:
    """The worker to serve: ``worker``, else ``KSERVE_TRIO_WORKER_NAME``, else the sole worker.

    Returns ``(name, chosen_by_env)``; an unknown name or an ambiguous node is a ConfigError.
    """
    env = with_upstream_aliases(env)
    names = worker_names(node)
    by_env = worker is None and bool(env.get(WORKER_NAME_ENV))
    chosen = worker if worker is not None else env.get(WORKER_NAME_ENV) or None
    if chosen is None:
        if len(names) != 1:
            raise ConfigError(
                f"node has {len(names)} workers; specify which to serve "
                f"(name it, or set {WORKER_NAME_ENV}; have: {', '.join(names)})"
            )
        return names[0], False
    if chosen not in names:
        raise ConfigError(f"worker '{chosen}' not defined in node (have: {', '.join(names)})")
    return chosen, by_env


def node_server_config(
    node: Mapping[str, Any], worker: str | None = None, env: Mapping[str, str] = os.environ
) -> tuple[ServerConfig, list[tuple[str, str]], str]:
    """Resolve (not validate) one worker's ``ServerConfig``: node, then environment overrides.

    Returns ``(config, applied env pairs, worker name)``; ``load_server_config`` is the full
    pipeline (adds command-line overrides and ``validate_config``).
    """
    env = with_upstream_aliases(env)
    name, by_env = choose_worker(node, worker, env)
    raw, applied = apply_env_overrides(worker_raw_config(node, name), env)
    if by_env:
        applied.append((WORKER_NAME_ENV, env[WORKER_NAME_ENV]))
    return dataclasses.replace(build_config(raw), worker_name=name), applied, name


def load_server_config(
    node_path: str | os.PathLike[str] | None = None,
    worker: str | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
    check_dirs: bool = True,
) -> tuple[ServerConfig, list[tuple[str, str]]]:
    """Resolve, build and validate one worker's configuration; THE entry point of a worker.

    Layers, lowest first: the dataclass defaults; the node file's entry for ``worker`` (or
    ``KSERVE_TRIO_WORKER_NAME``, or the sole worker; see ``worker_raw_config``); the
    environment; ``overrides``, a raw dict in YAML shape holding the command-line flags (``None``
    values mean "flag not given" and are dropped). Returns the config and the applied
    environment ``(VAR, value)`` pairs for logging.
    """
    env = with_upstream_aliases(env)
    if node_path is not None:
        loaded = load_node(node_path)
        name, chosen_by_env = choose_worker(loaded, worker, env)
        raw: dict[str, Any] = worker_raw_config(loaded, name)
    else:
        name = worker or env.get(WORKER_NAME_ENV, "")
        chosen_by_env = worker is None and bool(env.get(WORKER_NAME_ENV))
        raw = {}
    raw, applied = apply_env_overrides(raw, env)
    if chosen_by_env:
        applied.append((WORKER_NAME_ENV, env[WORKER_NAME_ENV]))
    if overrides:
        raw = merge_given(raw, overrides)
    cfg = dataclasses.replace(build_config(raw), worker_name=name)
    validate_config(cfg, check_dirs=check_dirs)
    return cfg, applied


def node_gpus(node: Mapping[str, Any]) -> Literal["auto"] | int | list[str]:
    """The ``gpus:`` key: ``"auto"`` (default, any case), a count ``>= 0`` or a non-empty list
    of device selectors (ordinals or GPU UUIDs, passed to CUDA_VISIBLE_DEVICES verbatim)."""
    if "gpus" not in node:
        return "auto"
    g = node["gpus"]
    if isinstance(g, str) and g.strip().lower() == "auto":
        return "auto"
    if is_int(g):
        if g < 0:
            raise ConfigError("node config 'gpus' count must be >= 0", "gpus")
        return g
    if isinstance(g, list):
        if not g:
            raise ConfigError("node config 'gpus' list must not be empty", "gpus")
        out = []
        for d in g:
            if is_int(d) and d >= 0:
                out.append(str(d))
            elif isinstance(d, str) and d.strip():
                out.append(d.strip())
            else:
                raise ConfigError(
                    "node config 'gpus' entries must be device ordinals or UUID strings", "gpus"
                )
        return out
    raise ConfigError(
        "node config 'gpus' must be 'auto', an integer count, or a list of devices", "gpus"
    )


def materialize_node(
    node: MutableMapping[str, Any], devices: Sequence[str], cpu_workers: int = 1
) -> list[str | None]:
    """Assign one visible device per worker (mutating ``node``); return the selectors.

    Rules:
    1. no ``workers:`` -> synthesize ``worker0..worker{N-1}``, N = len(devices), or
       ``cpu_workers`` (>= 1) when there are no devices; selectors = devices (or all None);
    2. an explicit list wins: worker i gets ``devices[i]``, or ``devices[gpu]`` when it has a
       ``gpu:`` key, which is then deleted (the child sees one device, at ordinal 0);
    3. a worker needing a device that is not visible, or two workers on one device, is a
       ConfigError; with no devices every selector is None and ``gpu:`` keys stay;
    4. devices left unused are logged. Call ``validate_node`` on the result.
    """
    devs = [str(d) for d in devices]
    if "workers" not in node:
        n = len(devs) if devs else cpu_workers
        if n < 1:
            raise ConfigError("cannot materialize a node with no devices and cpu_workers < 1")
        node["workers"] = [{"name": f"worker{i}"} for i in range(n)]
        return list(devs) if devs else [None] * n

    workers = _workers(node)
    if not devs:
        return [None] * len(workers)
    selectors: list[str | None] = []
    assigned: dict[str, str] = {}
    for i, w in enumerate(workers):
        name = _name(w, i)
        index = i
        if "gpu" in w:
            if not (is_int(w["gpu"]) and w["gpu"] >= 0):
                raise ConfigError(
                    f"node worker '{name}' gpu must be a non-negative integer", f"workers[{i}].gpu"
                )
            index = w["gpu"]
        if index >= len(devs):
            raise ConfigError(
                f"node worker '{name}' needs device {index} but only {len(devs)} device(s) "
                "are visible"
            )
        dev = devs[index]
        if dev in assigned:
            raise ConfigError(
                f"node workers '{assigned[dev]}' and '{name}' are both assigned device '{dev}'; "
                "set distinct 'gpu' keys"
            )
        assigned[dev] = name
        w.pop("gpu", None)
        selectors.append(dev)
    unused = len(devs) - len(assigned)
    if unused:
        _log.info("devices_unused", note=f"{unused} visible device(s) left unused")
    return selectors


__all__ = [
    "NODE_KEYS",
    "ROLES",
    "WORKER_RESERVED",
    "choose_worker",
    "load_node",
    "load_node_raw",
    "load_server_config",
    "materialize_node",
    "node_gpus",
    "node_server_config",
    "validate_node",
    "worker_names",
    "worker_raw_config",
]
