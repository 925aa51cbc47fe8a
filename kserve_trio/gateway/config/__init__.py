"""The gateway's typed configuration: ``GatewayConfig``, the ``gateway.yml`` schema, the
``KSERVE_TRIO_GATEWAY_*`` environment overrides, validation and the one loading entry point.

It follows the worker configuration's conventions and reuses its helpers
(``kserve_trio.core.process.config``): the dataclass defaults are the YAML defaults, every value is
type-checked with the same messages, and every error is a ``ConfigError`` naming the YAML path
of the key. Precedence is defaults < ``gateway.yml`` < environment < command-line overrides.

No key is inert: every accepted key is implemented, an unknown key is an error naming its path,
and a key that means something only under one scheduling mode is an error under the others:
``scheduling.work_basis`` (``least_outstanding``, ``lpt_packing``) and the keys of
``lpt_packing`` (placement by measured load, ``LPT_SCHEDULING_KEYS``).

Four settings are environment-only (runtime knobs, not ``gateway.yml`` keys), in
``ProberConfig``: ``KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS``, ``..._HEALTH_INTERVAL_SECONDS``,
``..._WEDGE_EXIT_ROUNDS`` and ``..._HOSTS_FILE``.

This package states the public names once; the parts live in private modules: ``_types``
(enums and dataclasses), ``_schema`` (the key schema and the builder), ``_env`` (the
environment), ``_validate`` (range checks and warnings), ``_load`` (the entry point, reporting).
"""

from __future__ import annotations

from kserve_trio.gateway.config._env import (
    ENV_OVERRIDES,
    PROBER_ENV,
    PROBER_ENV_NAME,
    apply_gateway_env,
    prober_from_env,
)
from kserve_trio.gateway.config._load import (
    LoadedGatewayConfig,
    configure_gateway_logging,
    gateway_config_to_raw,
    load_gateway_config,
    log_gateway_config,
)
from kserve_trio.gateway.config._schema import (
    LPT_SCHEDULING_KEYS,
    SCHEMA,
    build_gateway_config,
    schema_paths,
)
from kserve_trio.gateway.config._types import (
    ALL_REPLICAS,
    ENV_PREFIX,
    FILE_ENV,
    LOG_FORMATS,
    MAX_PROCESSES,
    NO_ENDPOINTS,
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
from kserve_trio.gateway.config._validate import (
    INFLIGHT_WARNING,
    config_warnings,
    validate_gateway_config,
    validate_scheduling,
)

__all__ = [
    "ALL_REPLICAS",
    "ENV_OVERRIDES",
    "ENV_PREFIX",
    "FILE_ENV",
    "INFLIGHT_WARNING",
    "LOG_FORMATS",
    "LPT_SCHEDULING_KEYS",
    "MAX_PROCESSES",
    "NO_ENDPOINTS",
    "PROBER_ENV",
    "PROBER_ENV_NAME",
    "SCHEMA",
    "CompactionMode",
    "FillMode",
    "FillPolicy",
    "GatewayConfig",
    "GatewayGrpcConfig",
    "ListenConfig",
    "LoadedGatewayConfig",
    "LoggingConfig",
    "ModelPlacementConfig",
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
    "validate_scheduling",
]
