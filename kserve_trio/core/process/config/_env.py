"""The worker configuration's environment overrides: the table of ``INFERENCE_SERVER_*`` /
``KSERVE_TRIO_*`` variables, their parsing by kind and ``apply_env_overrides``.

The table is explicit (field names contain underscores, so a variable name cannot be split into
a path), and a variable under the prefix that is not in it is an error: a typo must not be inert.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config._limits import limits_env_rows
from kserve_trio.core.process.config._raw import deep_merge, set_path
from kserve_trio.core.process.config._schema import BATCH_POLICY_REMOVED, RESIDENCY_MODE_REMOVED
from kserve_trio.core.process.config._tracing import tracing_env_rows
from kserve_trio.core.process.config._types import ENV_PREFIX, FrozenMap
from kserve_trio.core.process.upstream_env import with_upstream_aliases

# variable (INFERENCE_SERVER_ prefix implied unless spelled out)   YAML path   kind
_ENV_TABLE_TEXT = """
CACHE_DIR                              cache_dir                           str
MODEL_POLL_SECONDS                     model_poll_seconds                  float
MODEL_CONTROL_MODE                     model_control_mode                  str
MODEL_DIRS                             model_dirs                          list
MODELS_INCLUDE                         models_include                      list
SERVE_WITHOUT_HOOKS                    serve_without_hooks                 bool
RUNTIME_BACKEND                        runtime.backend                     str
RUNTIME_DEVICE_ORDINAL                 runtime.device_ordinal              int
RUNTIME_MEM_FRACTION                   runtime.mem_fraction                float
RUNTIME_PREALLOCATE                    runtime.preallocate                 bool
RUNTIME_ALLOW_CPU_FALLBACK             runtime.allow_cpu_fallback          bool
RUNTIME_WEIGHT_CACHE_FRACTION          runtime.weight_cache_fraction       float
RUNTIME_WEIGHT_CACHE_WIGGLE_FRACTION   runtime.weight_cache_wiggle_fraction float
RUNTIME_AUTOTUNE                       runtime.autotune                    bool
RUNTIME_AUTOTUNE_CACHE                 runtime.autotune_cache              bool
RUNTIME_AUTOTUNE_CACHE_DIR             runtime.autotune_cache_dir          str
RUNTIME_NUMERICS                       runtime.numerics                    str
RUNTIME_SHARED_HOST_WEIGHTS            runtime.shared_host_weights         bool
RUNTIME_SHARED_HOST_WEIGHTS_MODE       runtime.shared_host_weights_mode    str
RUNTIME_CPU_DEVICE_MEMORY_BYTES        runtime.cpu_device_memory_bytes     int
SCHEDULER_DISCIPLINE                   scheduler.discipline                str
SCHEDULER_EMA_HALFLIFE_SECONDS         scheduler.ema_halflife_seconds      float
SCHEDULER_RECENCY_PENALTY_CAP          scheduler.recency_penalty_cap       float
SCHEDULER_COALESCING_DISCOUNT          scheduler.coalescing_discount       float
SCHEDULER_COST_EMA_ALPHA               scheduler.cost_ema_alpha            float
SCHEDULER_MAX_QUEUE_DEPTH              scheduler.max_queue_depth           int
SCHEDULER_DISPATCH_TIMEOUT_SECONDS     scheduler.dispatch_timeout_seconds  float
SCHEDULER_COMPACTION_INTERVAL          scheduler.compaction_interval       int
ENDPOINTS_HOST                         endpoints.host                      str
ENDPOINTS_PORT                         endpoints.port                      int
ENDPOINTS_METRICS_PORT                 endpoints.metrics_port              int
ENDPOINTS_HTTP_PORT                    endpoints.http_port                 int
ENDPOINTS_MAX_CONCURRENT_REQUESTS      endpoints.max_concurrent_requests   int
ENDPOINTS_EVENT_LOOP                   endpoints.event_loop                str
ENDPOINTS_HTTP2_ENGINE                 endpoints.http2_engine              str
ENDPOINTS_RESTRICTED_PROTOCOLS         endpoints.restricted_protocols      specs
ENDPOINTS_FRONTEND_PROCESSES           endpoints.frontend_processes        int
ENDPOINTS_FRONTEND_LIVENESS_INTERVAL_SECONDS endpoints.frontend_liveness_interval_seconds float
ENDPOINTS_FRONTEND_LIVENESS_MISSES     endpoints.frontend_liveness_misses  int
ENDPOINTS_CLIENT_SHARED_MEMORY         endpoints.client_shared_memory      bool
ENDPOINTS_CLIENT_SHARED_MEMORY_PREFIXES endpoints.client_shared_memory_prefixes list
ENDPOINTS_TLS_CERT_FILE                endpoints.tls.cert_file             str
ENDPOINTS_TLS_KEY_FILE                 endpoints.tls.key_file              str
ENDPOINTS_TLS_CLIENT_CA_FILE           endpoints.tls.client_ca_file        str
GRPC_MAX_RECV_MSG_BYTES                grpc.max_recv_msg_bytes             int
GRPC_MAX_SEND_MSG_BYTES                grpc.max_send_msg_bytes             int
GRPC_COMPRESS_RESPONSES                grpc.compress_responses             bool
KSERVE_TRIO_FANOUT_BYTES               meta.fanout_bytes                   int
KSERVE_TRIO_FANOUT_SLOTS               meta.fanout_slots                   int
"""
_ENV_TABLE: tuple[tuple[str, str, str], ...] = (
    *(
        (var if var.startswith("KSERVE_TRIO_") else ENV_PREFIX + var, path, kind)
        for var, path, kind in (line.split() for line in _ENV_TABLE_TEXT.strip().splitlines())
    ),
    *limits_env_rows(ENV_PREFIX),
    *tracing_env_rows(ENV_PREFIX),
)
ENV_OVERRIDES: Mapping[str, str] = FrozenMap((var, path) for var, path, _ in _ENV_TABLE)
"""Every environment variable that overrides a config key -> the YAML path it sets."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_KIND_NAMES = {"int": "integer", "float": "number", "bool": "boolean"}


def parse_env_bool(var: str, text: str, path: str = "") -> bool:
    """``1|true|yes|on`` / ``0|false|no|off`` (any case, trimmed); anything else is an error."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(
        f"environment override {var} has invalid boolean value {text!r} "
        "(expected 1|true|yes|on or 0|false|no|off)",
        path,
    )


def parse_env_value(var: str, text: str, path: str, kind: str) -> Any:
    """One variable's text by the table's ``kind``: ``str`` as is, ``list`` colon-separated with
    empties dropped, ``specs`` the same but ``;``-separated (its entries hold colons:
    ``group,group:key=value``), ``bool`` per ``parse_env_bool``, ``int``/``float`` strictly."""
    if kind == "str":
        return text
    if kind == "list":
        return [part for part in text.split(":") if part]
    if kind == "specs":
        return [part.strip() for part in text.split(";") if part.strip()]
    if kind == "bool":
        return parse_env_bool(var, text, path)
    try:
        return int(text.strip()) if kind == "int" else float(text.strip())
    except ValueError:
        raise ConfigError(
            f"environment override {var} has invalid {_KIND_NAMES[kind]} value {text!r}", path
        ) from None


def apply_env_overrides(
    raw: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Apply the environment table to a copy of ``raw``; return it and the applied pairs.

    Rules:
    1. ``INFERENCE_SERVER_BATCH_POLICY_*`` and ``INFERENCE_SERVER_RUNTIME_RESIDENCY_MODE`` fail
       with the migration messages; ``KSERVE_TRIO_META_CONCURRENCY`` fails (no meta gate);
    2. any other unknown ``INFERENCE_SERVER_*`` variable fails (a typo must not be inert);
    3. known variables are parsed by kind (int/float/bool strictly, lists colon-separated with
       empties dropped) and set at their YAML path, in table order; ``raw`` is not modified.

    Upstream ``REACTANT_*`` names are read as their new names first (``core.process.upstream_env``).
    """
    env = with_upstream_aliases(env)
    for var in sorted(env):
        if var.startswith(ENV_PREFIX + "BATCH_POLICY_"):
            raise ConfigError(f"environment override {var}: {BATCH_POLICY_REMOVED}")
        if var == ENV_PREFIX + "RUNTIME_RESIDENCY_MODE":
            raise ConfigError(f"environment override {var}: {RESIDENCY_MODE_REMOVED}")
        if var == "KSERVE_TRIO_META_CONCURRENCY":
            raise ConfigError(
                f"{var} is not supported: a meta model runs on the device thread as one "
                "scheduled unit, so there is no meta concurrency gate to size"
            )
        if var.startswith(ENV_PREFIX) and var not in ENV_OVERRIDES:
            raise unknown_env_override(var, ENV_OVERRIDES)
    return apply_env_table(raw, env, _ENV_TABLE)


def unknown_env_override(var: str, known: Iterable[str]) -> ConfigError:
    """The error of a variable under a configuration prefix that no key has, naming the
    closest known one (a typo must not be inert)."""
    close = difflib.get_close_matches(var, sorted(known), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown environment override {var}{hint}")


EnvParser = Callable[[str, str, str, str], Any]
"""``parse(var, text, path, kind) -> value``: one variable's value for its YAML path."""


def apply_env_table(
    raw: Mapping[str, Any],
    env: Mapping[str, str],
    table: Iterable[tuple[str, str, str]],
    parse: EnvParser | None = None,
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A copy of ``raw`` with every variable of ``table`` (``(var, path, kind)``) that ``env``
    sets parsed (``parse``, default ``parse_env_value``) and set at its path, in table order;
    and the ``(var, text)`` pairs applied."""
    parse = parse or parse_env_value
    out = deep_merge({}, raw)
    applied: list[tuple[str, str]] = []
    for var, path, kind in table:
        if var in env:
            set_path(out, path, parse(var, env[var], path, kind))
            applied.append((var, env[var]))
    return out, applied
