"""The gateway's typed configuration: ``GatewayConfig``, the ``gateway.yml`` schema, the
``KSERVE_TRIO_GATEWAY_*`` environment overrides, validation and the one loading entry point.

It follows the worker configuration's conventions and reuses its helpers
(``kserve_trio.core.config``): the dataclass defaults are the YAML defaults, every value is
type-checked with the same messages, and every error is a ``ConfigError`` naming the YAML path
of the key. Precedence is defaults < ``gateway.yml`` < environment < command-line overrides.

No key is inert: every accepted key is implemented, an unknown key is an error naming its path,
and the keys of the ``lpt_packing`` scheduling mode (placement by measured load) are rejected
with a message saying that mode is not available yet, rather than accepted and ignored.
``scheduling.work_basis`` is accepted only where it means something (``least_outstanding``).

Three settings are environment-only (runtime knobs, not ``gateway.yml`` keys), in
``ProberConfig``: ``KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS``, ``..._HEALTH_INTERVAL_SECONDS``
and ``..._WEDGE_EXIT_ROUNDS``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.core.config import (
    DEFAULT_GRPC_MSG_BYTES,
    TlsConfig,
    as_str,
    as_str_list,
    check_keys,
    deep_merge,
    load_yaml_mapping,
    parse_enum,
    parse_env_value,
    read_block,
    set_path,
    validate_tls,
)
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import configure_logging, get_logger, parse_level
from kserve_trio.gateway.addresses import parse_host_port

ENV_PREFIX = "KSERVE_TRIO_GATEWAY_"
FILE_ENV = "KSERVE_TRIO_GATEWAY_FILE"
"""The ``gateway.yml`` path when ``--config`` is not given (unset: environment only)."""

NO_ENDPOINTS = (
    "gateway has no endpoints; set 'endpoints:' in gateway.yml or KSERVE_TRIO_GATEWAY_WORKERS"
)
LPT_NOT_AVAILABLE = "lpt_packing is not available yet"


class SchedulingMode(enum.Enum):
    """How the gateway picks a replica for each request."""

    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"


class WorkBasis(enum.Enum):
    """What ``least_outstanding`` counts as a worker's outstanding work: requests, batch items,
    or estimated compute seconds (items times the model's measured cost per item)."""

    COMPUTE = "compute"
    ITEMS = "items"
    REQUESTS = "requests"


LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True)
class ListenConfig:
    """The gateway's own addresses (``listen:``): the KServe gRPC port and the admin HTTP port
    (``/metrics``, ``/healthz``, ``/readyz``, ``/routing``). Port 0 binds an ephemeral port."""

    grpc: str = "0.0.0.0:8001"
    metrics: str = "0.0.0.0:8002"

    @property
    def grpc_address(self) -> tuple[str, int]:
        return parse_host_port(self.grpc, allow_port_zero=True)

    @property
    def metrics_address(self) -> tuple[str, int]:
        return parse_host_port(self.metrics, allow_port_zero=True)


@dataclass(frozen=True)
class SchedulingConfig:
    """``scheduling:``. ``work_basis`` is ``None`` unless set; it may only be set under
    ``least_outstanding``, which counts compute when it is not (``basis``)."""

    mode: SchedulingMode = SchedulingMode.ROUND_ROBIN
    work_basis: WorkBasis | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_enum(SchedulingMode, self.mode, "scheduling.mode"))
        if self.work_basis is not None:
            basis = parse_enum(WorkBasis, self.work_basis, "scheduling.work_basis")
            object.__setattr__(self, "work_basis", basis)

    @property
    def basis(self) -> WorkBasis:
        return WorkBasis.COMPUTE if self.work_basis is None else self.work_basis


@dataclass(frozen=True)
class WorkerTlsConfig:
    """TLS from the gateway to its workers (``worker_client.tls``): the CA bundle the workers'
    certificates must chain to (empty: the system's CAs) and a client certificate and key for
    workers that require mutual TLS. Setting any of them turns TLS to the workers on."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)


@dataclass(frozen=True)
class WorkerClientConfig:
    """The gateway's connections to its workers (``worker_client:``): the timeout of a forwarded
    call that carries no deadline of its own, and the bound on in-flight calls (HTTP/2 streams)
    per worker connection; further calls wait for a slot, so one slow worker cannot absorb
    every request."""

    request_timeout_seconds: float = 60.0
    max_concurrent_streams: int = 32
    tls: WorkerTlsConfig = WorkerTlsConfig()


@dataclass(frozen=True)
class GatewayGrpcConfig:
    """``grpc:``: message caps in each direction, and the inbound admission cap per worker
    (the gateway admits ``max_concurrent_requests_per_worker`` times the number of workers
    concurrent requests and sheds the rest with RESOURCE_EXHAUSTED; 0 = uncapped)."""

    max_recv_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_send_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_concurrent_requests_per_worker: int = 64


@dataclass(frozen=True)
class LoggingConfig:
    """``logging:``: the level (``debug|info|warning|error|critical``) and the format (``json``,
    ``console``, or ``auto``: console on a TTY, JSON lines otherwise)."""

    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True)
class ProberConfig:
    """The environment-only runtime knobs of the prober (not ``gateway.yml`` keys).

    ``startup_wait_seconds``: how long the gateway waits at start-up for a worker to answer
    ServerReady before it serves anyway (0 = serve at once; ``math.inf`` = until one does).
    ``health_interval_seconds``: the period of the prober's rounds (readiness, discovery,
    routing table, routing metadata). ``wedge_exit_rounds``: once any worker has ever answered,
    this many consecutive rounds in which every probe timed out mean the gateway's own client
    stack is wedged, and it exits non-zero so its supervisor restarts it (0 = never).
    """

    startup_wait_seconds: float = 0.0
    health_interval_seconds: float = 10.0
    wedge_exit_rounds: int = 3


@dataclass(frozen=True)
class GatewayConfig:
    """The fully resolved configuration of one gateway process, frozen for its lifetime.

    ``endpoints`` are the workers' gRPC addresses (``host:port``; a name that resolves to
    several addresses is several workers). ``worker_metrics`` (optional) and ``worker_names``
    (optional) are index-aligned with ``endpoints``: entry ``i`` is the Prometheus endpoint and
    the label of the workers behind ``endpoints[i]``.
    """

    listen: ListenConfig = ListenConfig()
    endpoints: tuple[str, ...] = ()
    worker_metrics: tuple[str, ...] = ()
    worker_names: tuple[str, ...] = ()
    scheduling: SchedulingConfig = SchedulingConfig()
    worker_client: WorkerClientConfig = WorkerClientConfig()
    grpc: GatewayGrpcConfig = GatewayGrpcConfig()
    tls: TlsConfig = field(default_factory=TlsConfig)
    logging: LoggingConfig = LoggingConfig()
    prober: ProberConfig = ProberConfig()

    def __post_init__(self) -> None:
        for name in ("endpoints", "worker_metrics", "worker_names"):
            value = getattr(self, name)
            items = (value,) if isinstance(value, str) else tuple(value)
            object.__setattr__(self, name, tuple(item.strip() for item in items))


# ---------------------------------------------------------------------------------------------
# Schema: every accepted gateway.yml key (a leaf is None, a block is a dict).


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


def _check_gateway_keys(raw: Mapping[str, Any]) -> None:
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
    _check_gateway_keys(raw)
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


# ---------------------------------------------------------------------------------------------
# Environment overrides (table-driven; the KSERVE_TRIO_GATEWAY_ prefix is implied).

_ENV_TABLE_TEXT = """
LISTEN_GRPC                               listen.grpc                              str
LISTEN_METRICS                            listen.metrics                           str
WORKERS                                   endpoints                                csv
WORKER_METRICS                            worker_metrics                           csv
WORKER_NAMES                              worker_names                             csv
SCHEDULING_MODE                           scheduling.mode                          str
SCHEDULING_WORK_BASIS                     scheduling.work_basis                    str
WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS     worker_client.request_timeout_seconds    float
WORKER_CLIENT_MAX_CONCURRENT_STREAMS      worker_client.max_concurrent_streams     int
WORKER_CLIENT_TLS_CA_FILE                 worker_client.tls.ca_file                str
WORKER_CLIENT_TLS_CERT_FILE               worker_client.tls.cert_file              str
WORKER_CLIENT_TLS_KEY_FILE                worker_client.tls.key_file               str
GRPC_MAX_RECV_MSG_BYTES                   grpc.max_recv_msg_bytes                  int
GRPC_MAX_SEND_MSG_BYTES                   grpc.max_send_msg_bytes                  int
GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER   grpc.max_concurrent_requests_per_worker  int
TLS_CERT_FILE                             tls.cert_file                            str
TLS_KEY_FILE                              tls.key_file                             str
TLS_CLIENT_CA_FILE                        tls.client_ca_file                       str
LOGGING_LEVEL                             logging.level                            str
LOGGING_FORMAT                            logging.format                           str
"""
_ENV_TABLE: tuple[tuple[str, str, str], ...] = tuple(
    (ENV_PREFIX + var, path, kind)
    for var, path, kind in (line.split() for line in _ENV_TABLE_TEXT.strip().splitlines())
)
ENV_OVERRIDES: Mapping[str, str] = {var: path for var, path, _ in _ENV_TABLE}
"""Every environment variable that overrides a ``gateway.yml`` key -> the YAML path it sets."""

PROBER_ENV: Mapping[str, str] = {
    ENV_PREFIX + "STARTUP_WAIT_SECONDS": "startup_wait_seconds",
    ENV_PREFIX + "HEALTH_INTERVAL_SECONDS": "health_interval_seconds",
    ENV_PREFIX + "WEDGE_EXIT_ROUNDS": "wedge_exit_rounds",
}
"""The environment-only runtime knobs -> their ``ProberConfig`` field."""

PROBER_ENV_NAME: Mapping[str, str] = {name: var for var, name in PROBER_ENV.items()}
"""``ProberConfig`` field -> its environment variable (the "path" its errors name)."""


LPT_ENV = tuple(ENV_PREFIX + "SCHEDULING_" + key.upper() for key in LPT_SCHEDULING_KEYS[:-1])
_KNOWN_ENV = frozenset((*ENV_OVERRIDES, *PROBER_ENV, FILE_ENV))
_FOREVER = ("inf", "forever", "-1")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def apply_gateway_env(
    raw: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Apply the environment table to a copy of ``raw``; return it and the applied pairs.

    Rules:
    1. a ``KSERVE_TRIO_GATEWAY_SCHEDULING_*`` variable of an lpt_packing knob fails saying that
       mode is not available yet;
    2. any other unknown ``KSERVE_TRIO_GATEWAY_*`` variable fails (a typo must not be inert);
    3. known variables are parsed by kind (integers and numbers strictly; ``WORKERS``,
       ``WORKER_METRICS`` and ``WORKER_NAMES`` comma-separated, entries stripped, empty ones
       dropped, replacing the YAML list) and set at their YAML path; ``raw`` is not modified.
    """
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _KNOWN_ENV:
            continue
        if var in LPT_ENV:
            raise ConfigError(
                f"environment override {var} configures lpt_packing; {LPT_NOT_AVAILABLE}"
            )
        close = difflib.get_close_matches(var, sorted(_KNOWN_ENV), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown environment override {var}{hint}")
    out = deep_merge({}, raw)
    applied: list[tuple[str, str]] = []
    for var, path, kind in _ENV_TABLE:
        if var in env:
            text = env[var]
            value = _csv(text) if kind == "csv" else parse_env_value(var, text, path, kind)
            set_path(out, path, value)
            applied.append((var, text))
    return out, applied


def prober_from_env(env: Mapping[str, str]) -> tuple[ProberConfig, list[tuple[str, str]]]:
    """The runtime knobs from the environment, and the applied pairs.

    ``STARTUP_WAIT_SECONDS`` takes a number of seconds or ``inf`` / ``forever`` / ``-1``
    (wait until a worker is ready); ``HEALTH_INTERVAL_SECONDS`` a number; ``WEDGE_EXIT_ROUNDS``
    an integer. Ranges are checked by ``validate_gateway_config``.
    """
    values: dict[str, Any] = {}
    applied: list[tuple[str, str]] = []
    for var, name in PROBER_ENV.items():
        if var not in env:
            continue
        text = env[var]
        if name == "startup_wait_seconds" and text.strip().lower() in _FOREVER:
            values[name] = math.inf
        else:
            kind = "int" if name == "wedge_exit_rounds" else "float"
            values[name] = parse_env_value(var, text, var, kind)
        applied.append((var, text))
    return ProberConfig(**values), applied


# ---------------------------------------------------------------------------------------------
# Validation


def validate_gateway_config(cfg: GatewayConfig, *, check_files: bool = True) -> None:
    """Range and consistency checks, the same for YAML-, environment- and code-built configs.

    Each rule names the path it checks; comparisons are written as the valid range so a NaN
    fails too. ``check_files`` also requires every named TLS file to exist (off for a config
    checked away from the host that will serve it).
    """
    _validate_addresses(cfg)
    wc, grpc, pr = cfg.worker_client, cfg.grpc, cfg.prober
    rules: list[tuple[str, bool, str, Any]] = [
        (
            "worker_client.request_timeout_seconds",
            0 < wc.request_timeout_seconds < math.inf,
            "must be a positive number of seconds",
            wc.request_timeout_seconds,
        ),
        (
            "worker_client.max_concurrent_streams",
            wc.max_concurrent_streams > 0,
            "must be positive",
            wc.max_concurrent_streams,
        ),
        ("grpc.max_recv_msg_bytes", grpc.max_recv_msg_bytes > 0, "must be positive", None),
        ("grpc.max_send_msg_bytes", grpc.max_send_msg_bytes > 0, "must be positive", None),
        (
            "grpc.max_concurrent_requests_per_worker",
            grpc.max_concurrent_requests_per_worker >= 0,
            "must be >= 0 (0 = uncapped)",
            grpc.max_concurrent_requests_per_worker,
        ),
        (
            PROBER_ENV_NAME["startup_wait_seconds"],
            pr.startup_wait_seconds >= 0,
            "must be >= 0 seconds, or inf/forever/-1",
            pr.startup_wait_seconds,
        ),
        (
            PROBER_ENV_NAME["health_interval_seconds"],
            0 < pr.health_interval_seconds < math.inf,
            "must be a positive number of seconds",
            pr.health_interval_seconds,
        ),
        (
            PROBER_ENV_NAME["wedge_exit_rounds"],
            pr.wedge_exit_rounds >= 0,
            "must be >= 0 (0 = never exit)",
            pr.wedge_exit_rounds,
        ),
    ]
    for path, ok, rule, value in rules:
        if not ok:
            got = value if value is not None else _value_at(cfg, path)
            raise ConfigError(f"{rule} (got {got})", path)
    sched = cfg.scheduling
    if sched.work_basis is not None and sched.mode is not SchedulingMode.LEAST_OUTSTANDING:
        raise ConfigError(
            f"applies to scheduling mode least_outstanding only (mode is '{sched.mode.value}')",
            "scheduling.work_basis",
        )
    validate_tls(cfg.tls, check_files=check_files, prefix="tls")
    _validate_worker_tls(wc.tls, check_files=check_files)
    try:
        parse_level(cfg.logging.level)
    except (ValueError, AttributeError):
        raise ConfigError(
            f"must be one of debug, info, warning, error, critical (got {cfg.logging.level!r})",
            "logging.level",
        ) from None
    if cfg.logging.format not in LOG_FORMATS:
        raise ConfigError(
            f"must be one of {', '.join(LOG_FORMATS)} (got {cfg.logging.format!r})",
            "logging.format",
        )


def _value_at(cfg: GatewayConfig, path: str) -> Any:
    value: Any = cfg
    for key in path.split("."):
        value = getattr(value, key)
    return value


def _validate_addresses(cfg: GatewayConfig) -> None:
    for path, text in (("listen.grpc", cfg.listen.grpc), ("listen.metrics", cfg.listen.metrics)):
        try:
            parse_host_port(text, allow_port_zero=True)
        except ValueError as exc:
            raise ConfigError(str(exc), path) from None
    grpc_addr, metrics_addr = cfg.listen.grpc_address, cfg.listen.metrics_address
    if grpc_addr[1] != 0 and grpc_addr == metrics_addr:
        raise ConfigError(f"must differ from listen.grpc ({cfg.listen.grpc})", "listen.metrics")
    if not cfg.endpoints:
        raise ConfigError(NO_ENDPOINTS, "endpoints")
    seen: dict[tuple[str, int], int] = {}
    for i, entry in enumerate(cfg.endpoints):
        try:
            host, port = parse_host_port(entry)
        except ValueError as exc:
            raise ConfigError(str(exc), f"endpoints[{i}]") from None
        key = (host.lower(), port)
        if key in seen:
            raise ConfigError(f"repeats endpoints[{seen[key]}] ('{entry}')", f"endpoints[{i}]")
        seen[key] = i
    n = len(cfg.endpoints)
    for key, items in (("worker_metrics", cfg.worker_metrics), ("worker_names", cfg.worker_names)):
        if items and len(items) != n:
            raise ConfigError(
                f"must have one entry per endpoints entry, index-aligned "
                f"(got {len(items)} for {n} endpoints)",
                key,
            )
    for i, entry in enumerate(cfg.worker_metrics):
        try:
            parse_host_port(entry)
        except ValueError as exc:
            raise ConfigError(str(exc), f"worker_metrics[{i}]") from None
    names: dict[str, int] = {}
    for i, name in enumerate(cfg.worker_names):
        if not name or any(c.isspace() for c in name):
            raise ConfigError(
                f"must be a non-empty name without whitespace (got {name!r})", f"worker_names[{i}]"
            )
        if name in names:
            raise ConfigError(
                f"repeats worker_names[{names[name]}] ('{name}')", f"worker_names[{i}]"
            )
        names[name] = i


def _validate_worker_tls(tls: WorkerTlsConfig, *, check_files: bool) -> None:
    prefix = "worker_client.tls"
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "key_file" if tls.cert_file else "cert_file"
        present = "cert_file" if tls.cert_file else "key_file"
        raise ConfigError(f"must be set together with {present}", f"{prefix}.{missing}")
    for name in ("ca_file", "cert_file", "key_file") if check_files else ():
        path = getattr(tls, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"file does not exist: {path}", f"{prefix}.{name}")


def config_warnings(cfg: GatewayConfig) -> list[str]:
    """What is valid but probably not meant (logged at start-up)."""
    out = []
    cap = cfg.grpc.max_concurrent_requests_per_worker
    streams = cfg.worker_client.max_concurrent_streams
    if 0 < cap <= streams:
        out.append(
            f"grpc.max_concurrent_requests_per_worker ({cap}) is not above "
            f"worker_client.max_concurrent_streams ({streams}): requests are shed before the "
            "per-worker stream bound is reached, so none ever waits at the gateway for a slot"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Loading and reporting


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
    if path is None and env.get(FILE_ENV, "").strip():
        path = env[FILE_ENV].strip()
    raw: dict[str, Any] = {} if path is None else load_yaml_mapping(path, "gateway config")
    if path is not None:
        _check_gateway_keys(raw)  # errors name the file's own keys before env is merged
    raw, applied = apply_gateway_env(raw, env)
    prober, prober_applied = prober_from_env(env)
    if overrides:
        raw = deep_merge(raw, _drop_none(overrides))
    cfg = build_gateway_config(raw, prober)
    validate_gateway_config(cfg, check_files=check_files)
    return LoadedGatewayConfig(
        config=cfg,
        source=None if path is None else os.fspath(path),
        applied=tuple(applied + prober_applied),
        warnings=tuple(config_warnings(cfg)),
    )


def _drop_none(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out[key] = _drop_none(value)
        elif value is not None:
            out[key] = value
    return out


def gateway_config_to_raw(cfg: GatewayConfig) -> dict[str, Any]:
    """The config as a raw dict in YAML shape (``build_gateway_config`` inverts it; the
    environment-only ``prober`` knobs are not YAML keys and are left out)."""

    def block(obj: Any) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out

    client = block(cfg.worker_client)
    client["tls"] = block(cfg.worker_client.tls)
    scheduling = block(cfg.scheduling)
    if scheduling["work_basis"] is None:
        del scheduling["work_basis"]
    return {
        "listen": block(cfg.listen),
        "endpoints": list(cfg.endpoints),
        "worker_metrics": list(cfg.worker_metrics),
        "worker_names": list(cfg.worker_names),
        "scheduling": scheduling,
        "worker_client": client,
        "grpc": block(cfg.grpc),
        "tls": block(cfg.tls),
        "logging": block(cfg.logging),
    }


def log_gateway_config(loaded: LoadedGatewayConfig, log: Any = None) -> None:
    """Log the effective configuration, the environment overrides and the warnings."""
    log = log or get_logger(__name__)
    cfg = loaded.config
    log.info(
        "config_effective",
        source=loaded.source or "environment",
        config=gateway_config_to_raw(cfg),
        prober=dataclasses.asdict(cfg.prober),
    )
    if loaded.applied:
        overrides = [f"{var}={value}" for var, value in loaded.applied]
        log.info("config_overridden_by_environment", overrides=overrides)
    for warning in loaded.warnings:
        log.warning("config_warning", message=warning)


def configure_gateway_logging(cfg: LoggingConfig, stream: Any = None) -> None:
    """Apply ``logging:`` to this process (structlog and the standard library)."""
    configure_logging(cfg.format, cfg.level, stream=stream)  # type: ignore[arg-type]


__all__ = [
    "ENV_OVERRIDES",
    "ENV_PREFIX",
    "FILE_ENV",
    "LPT_NOT_AVAILABLE",
    "LPT_SCHEDULING_KEYS",
    "NO_ENDPOINTS",
    "PROBER_ENV",
    "SCHEMA",
    "GatewayConfig",
    "GatewayGrpcConfig",
    "ListenConfig",
    "LoadedGatewayConfig",
    "LoggingConfig",
    "ProberConfig",
    "SchedulingConfig",
    "SchedulingMode",
    "WorkBasis",
    "WorkerClientConfig",
    "WorkerTlsConfig",
    "apply_gateway_env",
    "build_gateway_config",
    "config_warnings",
    "configure_gateway_logging",
    "gateway_config_to_raw",
    "load_gateway_config",
    "log_gateway_config",
    "prober_from_env",
    "schema_paths",
    "validate_gateway_config",
]
