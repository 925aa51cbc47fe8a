"""A worker's typed configuration: the ``ServerConfig`` family, its YAML schema, the environment
overrides, validation and reporting.

One set of defaults holds however a config is built (YAML, code or command line): the dataclass
field defaults *are* the YAML defaults, and ``build_config`` only fills in what a raw dict sets.
Precedence everywhere is defaults < node file < ``INFERENCE_SERVER_*``/``KSERVE_TRIO_*``
environment < command-line overrides; ``kserve_trio.core.process.node.load_server_config`` layers them
(the node file sits above this package, so this package never imports it).

No key is inert: every accepted key is implemented somewhere, an unknown key anywhere is a
``ConfigError`` naming its YAML path, and the keys upstream removed (``batch_policy``,
``runtime.residency_mode``) fail with a migration message.

This package states the public names once; the parts live in private modules: ``_types`` (enums
and dataclasses), ``_schema`` (the key schema, the typed readers and ``build_config``), ``_env``
(the environment table), ``_validate`` (range and consistency checks), ``_report`` (back to YAML
shape, logging) and ``_raw`` (the raw-dict helpers the node and gateway configurations share:
``load_yaml_mapping``, ``deep_merge``, ``set_path``).
"""

from __future__ import annotations

from kserve_trio.core.process.config._env import (
    ENV_OVERRIDES,
    apply_env_overrides,
    apply_env_table,
    parse_env_bool,
    parse_env_value,
    unknown_env_override,
)
from kserve_trio.core.process.config._limits import (
    LIMIT_FIELDS,
    MAX_FRAME_BYTES,
    WINDOW_BYTES,
    EdgeLimits,
    limits_env_rows,
    validate_limits,
)
from kserve_trio.core.process.config._raw import (
    deep_merge,
    load_yaml_mapping,
    merge_given,
    set_path,
)
from kserve_trio.core.process.config._report import config_to_raw, log_config
from kserve_trio.core.process.config._schema import (
    BATCH_POLICY_REMOVED,
    RESIDENCY_MODE_REMOVED,
    SCHEMA,
    as_bool,
    as_float,
    as_int,
    as_str,
    as_str_list,
    build_config,
    check_keys,
    read_block,
)
from kserve_trio.core.process.config._tracing import (
    TRACE_LEVELS,
    TRACING_FIELDS,
    TRACING_READERS,
    TracingConfig,
    add_tracing_flags,
    tracing_env_rows,
    tracing_overrides,
    tracing_to_raw,
    validate_tracing,
)
from kserve_trio.core.process.config._types import (
    DEFAULT_GRPC_MSG_BYTES,
    ENV_PREFIX,
    LIVENESS_INTERVAL_SECONDS,
    LIVENESS_MISSES,
    WORKER_NAME_ENV,
    EndpointsConfig,
    FrozenMap,
    GrpcConfig,
    MetaConfig,
    ModelControlMode,
    ModelSchedConfig,
    NumericsMode,
    ResidencyMode,
    ResidencyState,
    RuntimeConfig,
    SchedulerConfig,
    SchedulingDiscipline,
    ServerConfig,
    TlsConfig,
    parse_enum,
)
from kserve_trio.core.process.config._validate import (
    validate_config,
    validate_shm_policy,
    validate_tls,
)

__all__ = [
    "BATCH_POLICY_REMOVED",
    "DEFAULT_GRPC_MSG_BYTES",
    "ENV_OVERRIDES",
    "ENV_PREFIX",
    "LIMIT_FIELDS",
    "LIVENESS_INTERVAL_SECONDS",
    "LIVENESS_MISSES",
    "MAX_FRAME_BYTES",
    "RESIDENCY_MODE_REMOVED",
    "SCHEMA",
    "TRACE_LEVELS",
    "TRACING_FIELDS",
    "TRACING_READERS",
    "WINDOW_BYTES",
    "WORKER_NAME_ENV",
    "EdgeLimits",
    "EndpointsConfig",
    "FrozenMap",
    "GrpcConfig",
    "MetaConfig",
    "ModelControlMode",
    "ModelSchedConfig",
    "NumericsMode",
    "ResidencyMode",
    "ResidencyState",
    "RuntimeConfig",
    "SchedulerConfig",
    "SchedulingDiscipline",
    "ServerConfig",
    "TlsConfig",
    "TracingConfig",
    "add_tracing_flags",
    "apply_env_overrides",
    "apply_env_table",
    "as_bool",
    "as_float",
    "as_int",
    "as_str",
    "as_str_list",
    "build_config",
    "check_keys",
    "config_to_raw",
    "deep_merge",
    "limits_env_rows",
    "load_yaml_mapping",
    "log_config",
    "merge_given",
    "parse_enum",
    "parse_env_bool",
    "parse_env_value",
    "read_block",
    "set_path",
    "tracing_env_rows",
    "tracing_overrides",
    "tracing_to_raw",
    "unknown_env_override",
    "validate_config",
    "validate_limits",
    "validate_shm_policy",
    "validate_tls",
    "validate_tracing",
]
