"""Loading (the one entry point: file, environment, flags), and reporting the effective
configuration."""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kserve_trio.core.logging import configure_logging, get_logger
from kserve_trio.core.process import (
    load_yaml_mapping,
    merge_given,
    redacted,
    tracing_to_raw,
    with_upstream_aliases,
)
from kserve_trio.gateway.config._env import apply_gateway_env, prober_from_env
from kserve_trio.gateway.config._schema import (
    LPT_SCHEDULING_KEYS,
    build_gateway_config,
    check_gateway_keys,
)
from kserve_trio.gateway.config._types import (
    ALL_REPLICAS,
    FILE_ENV,
    GatewayConfig,
    LoggingConfig,
    SchedulingMode,
)
from kserve_trio.gateway.config._validate import config_warnings, validate_gateway_config


@dataclass(frozen=True)
class LoadedGatewayConfig:
    """What ``load_gateway_config`` resolved: the config, the file it read (``None``: the
    environment only), the applied environment ``(VAR, value)`` pairs and the warnings."""

    config: GatewayConfig
    source: str | None
    applied: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]


def load_gateway_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
    check_files: bool = True,
) -> LoadedGatewayConfig:
    """Resolve, build and validate the gateway's configuration; THE entry point.

    The file is ``path`` (``--config``), else ``KSERVE_TRIO_GATEWAY_FILE``, else none
    (environment only; the endpoint list then comes from ``KSERVE_TRIO_GATEWAY_WORKERS``). A
    named file that does not exist is an error. ``overrides`` is a raw dict in YAML shape
    holding the command-line flags (``None`` values mean "flag not given").
    """
    env = with_upstream_aliases(env)  # REACTANT_GATEWAY_* read as KSERVE_TRIO_GATEWAY_*
    if path is None and env.get(FILE_ENV, "").strip():
        path = env[FILE_ENV].strip()
    raw: dict[str, Any] = {} if path is None else load_yaml_mapping(path, "gateway config")
    if path is not None:
        check_gateway_keys(raw)  # errors name the file's own keys before env is merged
    raw, applied = apply_gateway_env(raw, env)
    prober, prober_applied = prober_from_env(env)
    if overrides:
        raw = merge_given(raw, overrides)
    cfg = build_gateway_config(raw, prober)
    validate_gateway_config(cfg, check_files=check_files)
    return LoadedGatewayConfig(
        config=cfg,
        source=None if path is None else os.fspath(path),
        applied=tuple(applied + prober_applied),
        warnings=tuple(config_warnings(cfg)),
    )


def gateway_config_to_raw(cfg: GatewayConfig) -> dict[str, Any]:
    """The config as a raw dict in YAML shape (``build_gateway_config`` inverts it; the
    environment-only ``prober`` knobs are not YAML keys and are left out, and so are the
    lpt_packing keys under any other mode)."""

    def block(obj: Any) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out

    client = block(cfg.worker_client)
    client["tls"] = block(cfg.worker_client.tls)
    client["headers"] = list(cfg.worker_client.headers)
    scheduling = block(cfg.scheduling)
    if scheduling["work_basis"] is None:
        del scheduling["work_basis"]
    if scheduling["default_replicas"] == ALL_REPLICAS:
        scheduling["default_replicas"] = "all"
    models: dict[str, dict[str, Any]] = {}
    for name, model in cfg.scheduling.models.items():
        entry = {k: v for k, v in block(model).items() if v is not None and v != 0.0}
        if entry.get("replicas") == ALL_REPLICAS:
            entry["replicas"] = "all"
        models[name] = entry
    scheduling["models"] = models
    if cfg.scheduling.mode is not SchedulingMode.LPT_PACKING:  # its keys are invalid elsewhere
        for key in LPT_SCHEDULING_KEYS:
            del scheduling[key]
    return {
        "listen": block(cfg.listen),
        "endpoints": list(cfg.endpoints),
        "worker_metrics": list(cfg.worker_metrics),
        "worker_names": list(cfg.worker_names),
        "worker_http_endpoints": list(cfg.worker_http_endpoints),
        "scheduling": scheduling,
        "worker_client": client,
        "grpc": block(cfg.grpc),
        "tls": block(cfg.tls),
        "logging": block(cfg.logging),
        "event_loop": cfg.event_loop,
        "http2_engine": cfg.http2_engine,
        "limits": block(cfg.limits),
        "tracing": tracing_to_raw(cfg.tracing),
        "processes": cfg.processes,
        "process_liveness_interval_seconds": cfg.process_liveness_interval_seconds,
        "process_liveness_misses": cfg.process_liveness_misses,
        "restricted_protocols": list(cfg.restricted_protocols),
        "client_shared_memory": cfg.client_shared_memory,
        "client_shared_memory_prefixes": list(cfg.client_shared_memory_prefixes),
    }


def log_gateway_config(loaded: LoadedGatewayConfig, log: Any = None) -> None:
    """Log the effective configuration, the environment overrides and the warnings."""
    log = log or get_logger(__name__)
    cfg = loaded.config
    raw = gateway_config_to_raw(cfg)  # credentials redacted (core.process.restricted.redacted)
    raw["restricted_protocols"] = [redacted(s) for s in cfg.restricted_protocols]
    raw["worker_client"]["headers"] = [redacted(h) for h in cfg.worker_client.headers]
    log.info(
        "config_effective",
        source=loaded.source or "environment",
        config=raw,
        prober=dataclasses.asdict(cfg.prober),
    )
    if loaded.applied:
        secret = ("_RESTRICTED_PROTOCOLS", "_WORKER_CLIENT_HEADERS")
        overrides = [
            f"{var}={'***' if var.endswith(secret) else value}" for var, value in loaded.applied
        ]
        log.info("config_overridden_by_environment", overrides=overrides)
    for warning in loaded.warnings:
        log.warning("config_warning", message=warning)


def configure_gateway_logging(cfg: LoggingConfig, stream: Any = None) -> None:
    """Apply ``logging:`` to this process (structlog and the standard library)."""
    configure_logging(cfg.format, cfg.level, stream=stream)  # type: ignore[arg-type]
