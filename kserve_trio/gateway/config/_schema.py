"""The ``gateway.yml`` schema (every accepted key) and the builder that turns a raw dict into a
``GatewayConfig`` (type checks only: ranges are the validator's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import (
    EVENT_LOOPS,
    LIMIT_FIELDS,
    LIVENESS_INTERVAL_SECONDS,
    LIVENESS_MISSES,
    TRACING_FIELDS,
    TRACING_READERS,
    EdgeLimits,
    FrozenMap,
    TlsConfig,
    TracingConfig,
    as_bool,
    as_float,
    as_int,
    as_str,
    as_str_list,
    check_keys,
    parse_enum,
    read_block,
)
from kserve_trio.gateway.addresses import parse_host_port
from kserve_trio.gateway.config._types import (
    ALL_REPLICAS,
    CompactionMode,
    FillMode,
    FillPolicy,
    GatewayConfig,
    GatewayGrpcConfig,
    ListenConfig,
    LoggingConfig,
    ModelPlacementConfig,
    ProberConfig,
    SchedulingConfig,
    SchedulingMode,
    WorkBasis,
    WorkerClientConfig,
    WorkerTlsConfig,
)
from kserve_trio.http2 import DEFAULT_ENGINE, ENGINES


def _leaves(cls: type, *skip: str) -> dict[str, None]:
    return {f.name: None for f in dataclasses.fields(cls) if f.name not in skip}


SCHEMA: dict[str, Any] = {
    "listen": _leaves(ListenConfig),
    "endpoints": None,
    "worker_metrics": None,
    "worker_names": None,
    "worker_http_endpoints": None,
    "scheduling": {
        **_leaves(SchedulingConfig, "models"),
        "models": {"*": _leaves(ModelPlacementConfig)},
    },
    "worker_client": {
        **_leaves(WorkerClientConfig, "tls"),
        "tls": _leaves(WorkerTlsConfig),
    },
    "grpc": _leaves(GatewayGrpcConfig),
    "tls": _leaves(TlsConfig),
    "logging": _leaves(LoggingConfig),
    "event_loop": None,
    "http2_engine": None,
    "limits": {f.name: None for f in LIMIT_FIELDS},
    "tracing": {f.name: None for f in TRACING_FIELDS},
    "processes": None,
    "process_liveness_interval_seconds": None,
    "process_liveness_misses": None,
    "restricted_protocols": None,
    "client_shared_memory": None,
    "client_shared_memory_prefixes": None,
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
"""``scheduling.*`` keys that configure lpt_packing only (an error under any other mode)."""


def lpt_key_error(key: str, mode: SchedulingMode) -> ConfigError:
    """The error of an lpt_packing key set under another scheduling mode."""
    return ConfigError(
        f"configures scheduling mode lpt_packing (mode is '{mode.value}'); "
        "set scheduling.mode: lpt_packing or remove it",
        f"scheduling.{key}",
    )


_RENAMED = {"metrics_endpoints": "renamed to 'worker_metrics' (same meaning, same alignment)"}


def schema_paths(schema: Mapping[str, Any] = SCHEMA, prefix: str = "") -> list[str]:
    """Every leaf key of ``schema`` as a dotted YAML path, in schema order."""
    out: list[str] = []
    for key, sub in schema.items():
        path = f"{prefix}.{key}" if prefix else key
        out.extend(schema_paths(sub, path) if isinstance(sub, dict) else [path])
    return out


def check_gateway_keys(raw: Mapping[str, Any]) -> None:
    for key, message in _RENAMED.items():
        if key in raw:
            raise ConfigError(message, key)
    check_keys(raw, schema=SCHEMA)


# ---------------------------------------------------------------------------------------------
# Building from a raw dict (YAML shape): type checks only; ranges are validate's job.


def _mode(value: Any, path: str) -> SchedulingMode:
    return parse_enum(SchedulingMode, as_str(value, path), path)


def _replicas(value: Any, path: str) -> int:
    """A replica count: a positive integer or ``"all"`` (any case; ``ALL_REPLICAS``). An
    integer string is accepted too (the environment spells every value as text)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return ALL_REPLICAS
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(
                f"must be a positive integer or 'all' (got {value!r})", path
            ) from None
    count = as_int(value, path)
    if count < 1:
        raise ConfigError(f"must be a positive integer or 'all' (got {count})", path)
    return count


def _fill_policy(value: Any, path: str) -> FillPolicy:
    text = as_str(value, path)
    if text.strip().lower() == "least_outstanding":
        raise ConfigError(
            "'least_outstanding' is a scheduling mode, not an lpt_packing routing policy; "
            "use fill_least (the least loaded replica) or fill_rr (rotation)",
            path,
        )
    return parse_enum(FillPolicy, text, path)


def _model_placement(name: str, block: Any, prefix: str) -> ModelPlacementConfig:
    path = f"{prefix}.{name}"
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping", path)
    replicas = None
    if block.get("replicas") is not None:
        replicas = _replicas(block["replicas"], f"{path}.replicas")
    fill_mode = None
    if block.get("fill_mode") is not None:
        text = as_str(block["fill_mode"], f"{path}.fill_mode")
        if text.strip().lower() != "inherit":
            fill_mode = parse_enum(FillMode, text, f"{path}.fill_mode")
    factor = 0.0
    if block.get("fill_factor") is not None:
        factor = as_float(block["fill_factor"], f"{path}.fill_factor")
        if not factor > 0:
            raise ConfigError(f"must be > 0 (got {factor})", f"{path}.fill_factor")
    return ModelPlacementConfig(replicas, fill_mode, factor)


def _placements(value: Any, path: str) -> FrozenMap[ModelPlacementConfig]:
    if value is None:
        return FrozenMap()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping", path)
    return FrozenMap(
        (str(name), _model_placement(str(name), block, path)) for name, block in value.items()
    )


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
    1. ``metrics_endpoints`` fails with its rename message; any other unknown key fails
       naming its path;
    2. every value is type-checked (lists of strings, strings, integers, numbers);
    3. enum strings are matched case-insensitively; a replica count is a positive integer or
       ``"all"``; ``scheduling.routing_policy: least_outstanding`` fails with the names of the
       fill policies;
    4. ``endpoints`` entries are stripped, and repeated entries dropped (first kept) unless
       ``worker_names``, ``worker_metrics`` or ``worker_http_endpoints`` are index-aligned with
       them, where a repeat is
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
        {
            "mode": _mode,
            "work_basis": _basis,
            "default_replicas": _replicas,
            "routing_policy": _fill_policy,
            "routing_fill_mode": lambda v, p: parse_enum(FillMode, as_str(v, p), p),
            "compaction_mode": lambda v, p: parse_enum(CompactionMode, as_str(v, p), p),
            "models": _placements,
        },
    )
    if scheduling.mode is not SchedulingMode.LPT_PACKING:
        for key in LPT_SCHEDULING_KEYS:
            if key in _block(raw, "scheduling"):  # set, even to its default: not meant here
                raise lpt_key_error(key, scheduling.mode)
    client = read_block(
        WorkerClientConfig,
        _block(raw, "worker_client"),
        "worker_client",
        {
            "tls": lambda v, p: read_block(WorkerTlsConfig, v or {}, p, {}),
            "headers": as_str_list,
        },
    )
    grpc = read_block(GatewayGrpcConfig, _block(raw, "grpc"), "grpc", {})
    limits = read_block(EdgeLimits, _block(raw, "limits"), "limits", {})
    tracing = read_block(TracingConfig, _block(raw, "tracing"), "tracing", TRACING_READERS)
    tls = read_block(TlsConfig, _block(raw, "tls"), "tls", {})
    logging_ = read_block(LoggingConfig, _block(raw, "logging"), "logging", {})
    endpoints = [e.strip() for e in _list(raw, "endpoints")]
    names = _list(raw, "worker_names")
    metrics = _list(raw, "worker_metrics")
    http = _list(raw, "worker_http_endpoints")
    endpoints = _dedup_endpoints(endpoints, aligned=bool(names or metrics or http))
    event_loop = raw.get("event_loop") or ""
    if event_loop not in ("", *EVENT_LOOPS):
        raise ConfigError(
            f"must be uvloop, asyncio or trio (empty: uvloop when installed), not {event_loop!r}",
            "event_loop",
        )
    http2_engine = raw.get("http2_engine") or DEFAULT_ENGINE
    if http2_engine not in ENGINES:
        raise ConfigError(
            f"must be one of {', '.join(ENGINES)}, not {http2_engine!r}", "http2_engine"
        )
    processes = raw.get("processes")
    interval = raw.get("process_liveness_interval_seconds")
    misses = raw.get("process_liveness_misses")
    shm = raw.get("client_shared_memory")
    return GatewayConfig(
        processes=1 if processes is None else as_int(processes, "processes"),
        process_liveness_interval_seconds=LIVENESS_INTERVAL_SECONDS
        if interval is None
        else as_float(interval, "process_liveness_interval_seconds"),
        process_liveness_misses=LIVENESS_MISSES
        if misses is None
        else as_int(misses, "process_liveness_misses"),
        listen=listen,
        endpoints=tuple(endpoints),
        worker_metrics=metrics,
        worker_names=names,
        worker_http_endpoints=http,
        scheduling=scheduling,
        worker_client=client,
        grpc=grpc,
        tls=tls,
        logging=logging_,
        prober=prober or ProberConfig(),
        event_loop=event_loop,
        http2_engine=http2_engine,
        limits=limits,
        tracing=tracing,
        restricted_protocols=_list(raw, "restricted_protocols"),
        client_shared_memory=True if shm is None else as_bool(shm, "client_shared_memory"),
        client_shared_memory_prefixes=_list(raw, "client_shared_memory_prefixes"),
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
                    f"repeats endpoints[{first[key]}] ('{entry}'); with worker_names, "
                    "worker_metrics or worker_http_endpoints aligned to endpoints, list each "
                    "endpoint once",
                    f"endpoints[{i}]",
                )
            continue
        first[key] = i
        out.append(entry)
    return out
