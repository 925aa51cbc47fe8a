"""The ``gateway.yml`` schema (every accepted key) and the builder that turns a raw dict into a
``GatewayConfig`` (type checks only: ranges are the validator's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kserve_trio.core.config import (
    TlsConfig,
    as_str,
    as_str_list,
    check_keys,
    parse_enum,
    read_block,
)
from kserve_trio.core.errors import ConfigError
from kserve_trio.gateway.addresses import parse_host_port
from kserve_trio.gateway.config._types import (
    LPT_NOT_AVAILABLE,
    GatewayConfig,
    GatewayGrpcConfig,
    ListenConfig,
    LoggingConfig,
    ProberConfig,
    SchedulingConfig,
    SchedulingMode,
    WorkBasis,
    WorkerClientConfig,
    WorkerTlsConfig,
)


def _leaves(cls: type, *skip: str) -> dict[str, None]:
    return {f.name: None for f in dataclasses.fields(cls) if f.name not in skip}


SCHEMA: dict[str, Any] = {
    "listen": _leaves(ListenConfig),
    "endpoints": None,
    "worker_metrics": None,
    "worker_names": None,
    "scheduling": _leaves(SchedulingConfig),
    "worker_client": {
        **_leaves(WorkerClientConfig, "tls"),
        "tls": _leaves(WorkerTlsConfig),
    },
    "grpc": _leaves(GatewayGrpcConfig),
    "tls": _leaves(TlsConfig),
    "logging": _leaves(LoggingConfig),
}

LPT_SCHEDULING_KEYS = (
    "rebalance_compute_seconds",
    "first_rebalance_compute_seconds",
    "max_worker_share",
    "hysteresis",
    "ema_halflife_compute_seconds",
    "default_replicas",
    "routing_fill_factor",
    "routing_policy",
    "routing_fill_mode",
    "compaction_mode",
    "compaction_interval",
    "forbid_memory_oversubscription",
    "models",
)
"""``scheduling.*`` keys that configure lpt_packing only: rejected until that mode exists."""

_RENAMED = {"metrics_endpoints": "renamed to 'worker_metrics' (same meaning, same alignment)"}


def schema_paths(schema: Mapping[str, Any] = SCHEMA, prefix: str = "") -> list[str]:
    """Every leaf key of ``schema`` as a dotted YAML path, in schema order."""
    out: list[str] = []
    for key, sub in schema.items():
        path = f"{prefix}.{key}" if prefix else key
        out.extend(schema_paths(sub, path) if isinstance(sub, dict) else [path])
    return out


def _lpt_key_error(key: str) -> ConfigError:
    return ConfigError(
        f"'{key}' configures scheduling mode lpt_packing; {LPT_NOT_AVAILABLE} "
        "(modes: round_robin, least_outstanding)",
        f"scheduling.{key}",
    )


def check_gateway_keys(raw: Mapping[str, Any]) -> None:
    for key, message in _RENAMED.items():
        if key in raw:
            raise ConfigError(message, key)
    scheduling = raw.get("scheduling")
    if isinstance(scheduling, Mapping):
        for key in LPT_SCHEDULING_KEYS:
            if key in scheduling:
                raise _lpt_key_error(key)
    check_keys(raw, schema=SCHEMA)


# ---------------------------------------------------------------------------------------------
# Building from a raw dict (YAML shape): type checks only; ranges are validate's job.


def _mode(value: Any, path: str) -> SchedulingMode:
    text = as_str(value, path)
    if text.strip().lower() == "lpt_packing":
        raise ConfigError(f"{LPT_NOT_AVAILABLE}; use round_robin or least_outstanding", path)
    return parse_enum(SchedulingMode, text, path)


def _basis(value: Any, path: str) -> WorkBasis | None:
    return None if value is None else parse_enum(WorkBasis, as_str(value, path), path)


def _block(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    return {} if value is None else value


def _list(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key)
    return () if value is None else as_str_list(value, key)


def build_gateway_config(
    raw: Mapping[str, Any], prober: ProberConfig | None = None
) -> GatewayConfig:
    """Turn a raw dict (YAML shape) into a ``GatewayConfig``; absent keys keep the defaults.

    Rules, in order:
    1. ``metrics_endpoints`` fails with its rename message; an lpt_packing key under
       ``scheduling`` (or ``mode: lpt_packing``) fails saying that mode is not available yet;
       any other unknown key fails naming its path;
    2. every value is type-checked (lists of strings, strings, integers, numbers);
    3. enum strings are matched case-insensitively;
    4. ``endpoints`` entries are stripped, and repeated entries dropped (first kept) unless
       ``worker_names`` or ``worker_metrics`` are index-aligned with them, where a repeat is
       ambiguous and an error.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config root must be a mapping (got {type(raw).__name__})")
    check_gateway_keys(raw)
    listen = read_block(ListenConfig, _block(raw, "listen"), "listen", {})
    scheduling = read_block(
        SchedulingConfig,
        _block(raw, "scheduling"),
        "scheduling",
        {"mode": _mode, "work_basis": _basis},
    )
    client = read_block(
        WorkerClientConfig,
        _block(raw, "worker_client"),
        "worker_client",
        {"tls": lambda v, p: read_block(WorkerTlsConfig, v or {}, p, {})},
    )
    grpc = read_block(GatewayGrpcConfig, _block(raw, "grpc"), "grpc", {})
    tls = read_block(TlsConfig, _block(raw, "tls"), "tls", {})
    logging_ = read_block(LoggingConfig, _block(raw, "logging"), "logging", {})
    endpoints = [e.strip() for e in _list(raw, "endpoints")]
    names = _list(raw, "worker_names")
    metrics = _list(raw, "worker_metrics")
    endpoints = _dedup_endpoints(endpoints, aligned=bool(names or metrics))
    return GatewayConfig(
        listen=listen,
        endpoints=tuple(endpoints),
        worker_metrics=metrics,
        worker_names=names,
        scheduling=scheduling,
        worker_client=client,
        grpc=grpc,
        tls=tls,
        logging=logging_,
        prober=prober or ProberConfig(),
    )


def _endpoint_key(text: str) -> tuple[str, int] | str:
    try:
        host, port = parse_host_port(text)
    except ValueError:
        return text  # validate reports it with its index
    return host.lower(), port


def _dedup_endpoints(endpoints: list[str], *, aligned: bool) -> list[str]:
    first: dict[tuple[str, int] | str, int] = {}
    out = []
    for i, entry in enumerate(endpoints):
        key = _endpoint_key(entry)
        if key in first:
            if aligned:
                raise ConfigError(
                    f"repeats endpoints[{first[key]}] ('{entry}'); with worker_names or "
                    "worker_metrics aligned to endpoints, list each endpoint once",
                    f"endpoints[{i}]",
                )
            continue
        first[key] = i
        out.append(entry)
    return out
