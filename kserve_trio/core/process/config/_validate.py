"""Validation of a built worker configuration: ranges and consistency rules, the same for a
config built from YAML, in code or from the command line, and the TLS block check the gateway
shares."""

from __future__ import annotations

import math
import os
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.memory import ClientShmPolicy, prefix_problem, shown
from kserve_trio.core.process.config._limits import validate_limits
from kserve_trio.core.process.config._tracing import validate_tracing
from kserve_trio.core.process.config._types import (
    ModelControlMode,
    NumericsMode,
    ServerConfig,
    TlsConfig,
)
from kserve_trio.core.process.event_loops import EVENT_LOOPS
from kserve_trio.core.process.restricted import parse_restrictions
from kserve_trio.http2 import ENGINES


def validate_config(cfg: ServerConfig, *, check_dirs: bool = True) -> None:
    """Range and consistency checks, the same for YAML-, code- and CLI-built configs.

    Each rule is "path, holds?, what it must be"; comparisons are written as the valid range so
    a NaN fails too. ``check_dirs`` also requires every model directory to exist (off for
    configs checked away from the host that will serve them).
    """
    ep, sc, rt = cfg.endpoints, cfg.scheduler, cfg.runtime
    parse_restrictions(ep.restricted_protocols, "endpoints.restricted_protocols")
    rules: list[tuple[str, bool, str]] = [
        ("model_poll_seconds", cfg.model_poll_seconds >= 0, "must be >= 0"),
        ("endpoints.port", 0 <= ep.port <= 65535, "must be in 0..65535 (0 = ephemeral)"),
        ("endpoints.metrics_port", 0 <= ep.metrics_port <= 65535, "must be in 0..65535 (0 = off)"),
        ("endpoints.http_port", 0 <= ep.http_port <= 65535, "must be in 0..65535 (0 = off)"),
        (
            "endpoints.max_concurrent_requests",
            ep.max_concurrent_requests >= 0,
            "must be >= 0 (0 = uncapped)",
        ),
        (
            "endpoints.frontend_processes",
            ep.frontend_processes >= 1,
            "must be >= 1 (1: the worker serves its ports itself)",
        ),
        (
            "endpoints.frontend_liveness_interval_seconds",
            0 < ep.frontend_liveness_interval_seconds < math.inf,
            "must be a positive number of seconds",
        ),
        (
            "endpoints.frontend_liveness_misses",
            ep.frontend_liveness_misses >= 0,
            "must be >= 0 (0: never kill an unresponsive front end)",
        ),
        (
            "endpoints.event_loop",
            ep.event_loop in ("", *EVENT_LOOPS),
            "must be uvloop, asyncio or trio (empty: uvloop when installed)",
        ),
        (
            "endpoints.http2_engine",
            ep.http2_engine in ENGINES,
            f"must be one of {', '.join(ENGINES)}",
        ),
        ("grpc.max_recv_msg_bytes", cfg.grpc.max_recv_msg_bytes > 0, "must be positive"),
        ("grpc.max_send_msg_bytes", cfg.grpc.max_send_msg_bytes > 0, "must be positive"),
        ("scheduler.ema_halflife_seconds", sc.ema_halflife_seconds > 0, "must be positive"),
        ("scheduler.recency_penalty_cap", 0 < sc.recency_penalty_cap <= 1, "must be in (0, 1]"),
        ("scheduler.coalescing_discount", 0 <= sc.coalescing_discount < 1, "must be in [0, 1)"),
        ("scheduler.cost_ema_alpha", 0 < sc.cost_ema_alpha <= 1, "must be in (0, 1]"),
        ("scheduler.max_queue_depth", sc.max_queue_depth > 0, "must be positive"),
        (
            "scheduler.dispatch_timeout_seconds",
            sc.dispatch_timeout_seconds >= 0,
            "must be >= 0 (0 = off)",
        ),
        ("scheduler.compaction_interval", sc.compaction_interval >= 0, "must be >= 0 (0 = off)"),
        ("runtime.device_ordinal", rt.device_ordinal >= 0, "must be >= 0"),
        ("runtime.mem_fraction", 0 < rt.mem_fraction <= 1, "must be in (0, 1]"),
        (
            "runtime.weight_cache_fraction",
            0 <= rt.weight_cache_fraction <= 1,
            "must be in [0, 1] (0 = cache off)",
        ),
        (
            "runtime.weight_cache_wiggle_fraction",
            0 <= rt.weight_cache_wiggle_fraction < 1,
            "must be in [0, 1)",
        ),
        (
            "runtime.shared_host_weights_mode",
            0 <= rt.shared_host_weights_mode <= 0o777,
            "must be in 0..0o777",
        ),
        (
            "runtime.cpu_device_memory_bytes",
            rt.cpu_device_memory_bytes >= 0,
            "must be >= 0 (0 = none)",
        ),
    ]
    for path, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{rule} (got {_value_at(cfg, path)})", path)
    for model, mc in sc.models.items():
        path = f"scheduler.models.{model}"
        if not mc.weight > 0:
            raise ConfigError(f"must be positive (got {mc.weight})", f"{path}.weight")
        if mc.max_batch_size is not None and mc.max_batch_size < 1:
            raise ConfigError(f"must be >= 1 (got {mc.max_batch_size})", f"{path}.max_batch_size")

    if not cfg.model_dirs:
        raise ConfigError("at least one model directory is required", "model_dirs")
    for d in cfg.model_dirs if check_dirs else ():
        if not os.path.isdir(d):
            raise ConfigError(f"model directory does not exist: {d}", "model_dirs")
    if cfg.model_control_mode is ModelControlMode.DYNAMIC and not cfg.model_poll_seconds > 0:
        raise ConfigError(
            "model_control_mode 'dynamic' requires model_poll_seconds > 0", "model_poll_seconds"
        )
    if ep.metrics_port != 0 and ep.metrics_port == ep.port:
        raise ConfigError(f"must differ from endpoints.port ({ep.port})", "endpoints.metrics_port")
    if ep.http_port != 0 and ep.http_port in (ep.port, ep.metrics_port):
        raise ConfigError(
            f"must differ from endpoints.port ({ep.port}) and endpoints.metrics_port "
            f"({ep.metrics_port})",
            "endpoints.http_port",
        )
    validate_tls(ep.tls, check_files=check_dirs)
    validate_shm_policy(ep.shm_policy)
    validate_limits(cfg.limits)
    validate_tracing(cfg.tracing)
    if rt.numerics is NumericsMode.TF32 and rt.backend == "cpu":
        raise ConfigError(
            "'tf32' requires a CUDA backend; the CPU backend cannot run TF32", "runtime.numerics"
        )


def validate_tls(tls: TlsConfig, *, check_files: bool, prefix: str = "endpoints.tls") -> None:
    """A TLS block (``endpoints.tls``, or ``prefix``): cert and key both or neither; a client CA
    needs them (mutual TLS is TLS plus client certificates); with ``check_files`` every named
    file must exist."""
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "key_file" if tls.cert_file else "cert_file"
        present = "cert_file" if tls.cert_file else "key_file"
        raise ConfigError(f"must be set together with {present}", f"{prefix}.{missing}")
    if tls.client_ca_file and not tls.cert_file:
        raise ConfigError(
            "requires cert_file and key_file (mutual TLS is TLS plus client certificates)",
            f"{prefix}.client_ca_file",
        )
    for name in ("cert_file", "key_file", "client_ca_file") if check_files else ():
        path = getattr(tls, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"file does not exist: {path}", f"{prefix}.{name}")


def _value_at(cfg: ServerConfig, path: str) -> Any:
    value: Any = cfg
    for key in path.split("."):
        value = getattr(value, key)
    return value


def validate_shm_policy(policy: ClientShmPolicy) -> None:
    """The client shared-memory keys of a worker or a gateway: every allow-list entry is a
    key's start that can match a registrable key (``shm_names.prefix_problem``), and a list
    is refused with client shared memory off, where it would do nothing."""
    path = policy.prefixes_setting
    for prefix in policy.prefixes:
        problem = prefix_problem(prefix)
        if problem is not None:
            raise ConfigError(f"entry {shown(prefix)} {problem}", path)
    if policy.prefixes and not policy.enabled:
        raise ConfigError(
            f"has no effect with {policy.setting}: false (clients register nothing); "
            "remove it or turn client shared memory on",
            path,
        )
