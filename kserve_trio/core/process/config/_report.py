"""Reporting a worker configuration: back to the raw YAML shape, and the startup log lines."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process.config._tracing import tracing_to_raw
from kserve_trio.core.process.config._types import ResidencyState, ServerConfig
from kserve_trio.core.process.restricted import redacted


def config_to_raw(cfg: ServerConfig) -> dict[str, Any]:
    """The config as a raw dict in YAML shape (``build_config`` inverts it; ``worker_name``,
    not being a YAML key, is left out). For logging the effective configuration."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum) and not isinstance(value, ResidencyState):
            return value.value
        if isinstance(value, tuple):
            return list(value)
        return value

    def block(obj: Any) -> dict[str, Any]:
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    runtime = block(cfg.runtime)
    runtime["shared_host_weights_mode"] = f"{cfg.runtime.shared_host_weights_mode:o}"
    scheduler = block(cfg.scheduler)
    scheduler["models"] = {
        name: {
            "weight": mc.weight,
            "residency": None if mc.residency is None else mc.residency.name.lower(),
            "max_batch_size": mc.max_batch_size,
        }
        for name, mc in cfg.scheduler.models.items()
    }
    endpoints = block(cfg.endpoints)
    endpoints["tls"] = block(cfg.endpoints.tls)
    return {
        "model_dirs": list(cfg.model_dirs),
        "cache_dir": cfg.cache_dir,
        "models_include": list(cfg.models_include),
        "model_control_mode": cfg.model_control_mode.value,
        "model_poll_seconds": cfg.model_poll_seconds,
        "serve_without_hooks": cfg.serve_without_hooks,
        "runtime": runtime,
        "scheduler": scheduler,
        "endpoints": endpoints,
        "grpc": block(cfg.grpc),
        "meta": block(cfg.meta),
        "limits": block(cfg.limits),
        "tracing": tracing_to_raw(cfg.tracing),
    }


def log_config(cfg: ServerConfig, applied: Iterable[tuple[str, str]], log: Any = None) -> None:
    """Log the effective configuration, then the environment overrides that shaped it."""
    log = log or get_logger(__name__)
    raw = config_to_raw(cfg)
    raw["endpoints"]["restricted_protocols"] = [
        redacted(s) for s in cfg.endpoints.restricted_protocols
    ]
    log.info("config_effective", worker=cfg.worker_name, config=raw)
    overrides = [
        f"{var}={value if not var.endswith('_RESTRICTED_PROTOCOLS') else '***'}"
        for var, value in applied
    ]
    if overrides:
        log.info("config_overridden_by_environment", worker=cfg.worker_name, overrides=overrides)
