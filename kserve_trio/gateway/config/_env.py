"""The ``KSERVE_TRIO_GATEWAY_*`` environment: overrides of ``gateway.yml`` keys (table-driven)
and the environment-only prober knobs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kserve_trio.core.process import (
    apply_env_table,
    limits_env_rows,
    parse_env_value,
    tracing_env_rows,
    unknown_env_override,
)
from kserve_trio.gateway.config._types import ENV_PREFIX, FILE_ENV, ProberConfig

_ENV_TABLE_TEXT = """
LISTEN_GRPC                               listen.grpc                              str
LISTEN_METRICS                            listen.metrics                           str
LISTEN_HTTP                               listen.http                              str
WORKERS                                   endpoints                                csv
WORKER_METRICS                            worker_metrics                           csv
WORKER_NAMES                              worker_names                             csv
WORKER_HTTP_ENDPOINTS                     worker_http_endpoints                    csv
SCHEDULING_MODE                           scheduling.mode                          str
SCHEDULING_WORK_BASIS                     scheduling.work_basis                    str
SCHEDULING_REBALANCE_COMPUTE_SECONDS      scheduling.rebalance_compute_seconds     float
SCHEDULING_FIRST_REBALANCE_COMPUTE_SECONDS scheduling.first_rebalance_compute_seconds float
SCHEDULING_MAX_WORKER_SHARE               scheduling.max_worker_share              float
SCHEDULING_HYSTERESIS                     scheduling.hysteresis                    float
SCHEDULING_EMA_HALFLIFE_COMPUTE_SECONDS   scheduling.ema_halflife_compute_seconds  float
SCHEDULING_FORBID_MEMORY_OVERSUBSCRIPTION scheduling.forbid_memory_oversubscription bool
SCHEDULING_DEFAULT_REPLICAS               scheduling.default_replicas              str
SCHEDULING_ROUTING_FILL_FACTOR            scheduling.routing_fill_factor           float
SCHEDULING_ROUTING_POLICY                 scheduling.routing_policy                str
SCHEDULING_ROUTING_FILL_MODE              scheduling.routing_fill_mode             str
SCHEDULING_COMPACTION_MODE                scheduling.compaction_mode               str
SCHEDULING_COMPACTION_INTERVAL            scheduling.compaction_interval           int
WORKER_CLIENT_REQUEST_TIMEOUT_SECONDS     worker_client.request_timeout_seconds    float
WORKER_CLIENT_MAX_CONCURRENT_STREAMS      worker_client.max_concurrent_streams     int
WORKER_CLIENT_TLS_CA_FILE                 worker_client.tls.ca_file                str
WORKER_CLIENT_TLS_CERT_FILE               worker_client.tls.cert_file              str
WORKER_CLIENT_TLS_KEY_FILE                worker_client.tls.key_file               str
WORKER_CLIENT_HEADERS                     worker_client.headers                    specs
GRPC_MAX_RECV_MSG_BYTES                   grpc.max_recv_msg_bytes                  int
GRPC_MAX_SEND_MSG_BYTES                   grpc.max_send_msg_bytes                  int
GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER   grpc.max_concurrent_requests_per_worker  int
GRPC_MAX_QUEUED_REQUESTS_PER_WORKER       grpc.max_queued_requests_per_worker      int
TLS_CERT_FILE                             tls.cert_file                            str
TLS_KEY_FILE                              tls.key_file                             str
TLS_CLIENT_CA_FILE                        tls.client_ca_file                       str
LOGGING_LEVEL                             logging.level                            str
LOGGING_FORMAT                            logging.format                           str
EVENT_LOOP                                event_loop                               str
HTTP2_ENGINE                              http2_engine                             str
PROCESSES                                 processes                                int
PROCESS_LIVENESS_INTERVAL_SECONDS         process_liveness_interval_seconds        float
PROCESS_LIVENESS_MISSES                   process_liveness_misses                  int
RESTRICTED_PROTOCOLS                      restricted_protocols                     specs
CLIENT_SHARED_MEMORY                      client_shared_memory                     bool
CLIENT_SHARED_MEMORY_PREFIXES             client_shared_memory_prefixes            csv
"""
_ENV_TABLE: tuple[tuple[str, str, str], ...] = (
    *(
        (ENV_PREFIX + var, path, kind)
        for var, path, kind in (line.split() for line in _ENV_TABLE_TEXT.strip().splitlines())
    ),
    *limits_env_rows(ENV_PREFIX),
    *tracing_env_rows(ENV_PREFIX),
)
ENV_OVERRIDES: Mapping[str, str] = {var: path for var, path, _ in _ENV_TABLE}
"""Every environment variable that overrides a ``gateway.yml`` key -> the YAML path it sets."""

PROBER_ENV: Mapping[str, str] = {
    ENV_PREFIX + "STARTUP_WAIT_SECONDS": "startup_wait_seconds",
    ENV_PREFIX + "HEALTH_INTERVAL_SECONDS": "health_interval_seconds",
    ENV_PREFIX + "WEDGE_EXIT_ROUNDS": "wedge_exit_rounds",
    ENV_PREFIX + "HOSTS_FILE": "hosts_file",
}
"""The environment-only runtime knobs -> their ``ProberConfig`` field."""

PROBER_ENV_NAME: Mapping[str, str] = {name: var for var, name in PROBER_ENV.items()}
"""``ProberConfig`` field -> its environment variable (the "path" its errors name)."""


_KNOWN_ENV = frozenset((*ENV_OVERRIDES, *PROBER_ENV, FILE_ENV))
_FOREVER = ("inf", "forever", "-1")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def apply_gateway_env(
    raw: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Apply the environment table to a copy of ``raw``; return it and the applied pairs.

    Rules:
    1. an unknown ``KSERVE_TRIO_GATEWAY_*`` variable fails (a typo must not be inert);
    2. known variables are parsed by kind (integers and numbers strictly; ``WORKERS``,
       ``WORKER_METRICS``, ``WORKER_NAMES`` and ``WORKER_HTTP_ENDPOINTS`` comma-separated, entries stripped, empty ones
       dropped, replacing the YAML list; ``SCHEDULING_DEFAULT_REPLICAS`` as text, an integer or
       ``all``) and set at their YAML path; ``raw`` is not modified.
    """
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _KNOWN_ENV:
            continue
        raise unknown_env_override(var, _KNOWN_ENV)
    return apply_env_table(raw, env, _ENV_TABLE, _parse)


def _parse(var: str, text: str, path: str, kind: str) -> Any:
    return _csv(text) if kind == "csv" else parse_env_value(var, text, path, kind)


def prober_from_env(env: Mapping[str, str]) -> tuple[ProberConfig, list[tuple[str, str]]]:
    """The runtime knobs from the environment, and the applied pairs.

    ``STARTUP_WAIT_SECONDS`` takes a number of seconds or ``inf`` / ``forever`` / ``-1``
    (wait until a worker is ready); ``HEALTH_INTERVAL_SECONDS`` a number; ``WEDGE_EXIT_ROUNDS``
    an integer; ``HOSTS_FILE`` a path. Ranges are checked by ``validate_gateway_config``.
    """
    values: dict[str, Any] = {}
    applied: list[tuple[str, str]] = []
    for var, name in PROBER_ENV.items():
        if var not in env:
            continue
        text = env[var]
        if name == "hosts_file":
            values[name] = text.strip()
        elif name == "startup_wait_seconds" and text.strip().lower() in _FOREVER:
            values[name] = math.inf
        else:
            kind = "int" if name == "wedge_exit_rounds" else "float"
            values[name] = parse_env_value(var, text, var, kind)
        applied.append((var, text))
    return ProberConfig(**values), applied
