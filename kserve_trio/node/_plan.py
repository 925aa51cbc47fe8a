"""The node plan: from a node file and the environment to the exact children to run (pure).

``plan_node`` decides everything the supervisor does before it starts a process: the role, the
devices and the workers they get, each worker's port, command line, environment, thread budget
and CPUs, whether the embedded gateway runs and how it is configured, and the notes and
warnings to print. It reads nothing but its arguments (the machine arrives as ``Machine``
probes, a gateway file as its parsed contents), so every rule here has a plain test.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import (
    ENV_PREFIX,
    ROLES,
    WORKER_NAME_ENV,
    ServerConfig,
    apply_env_overrides,
    build_config,
    materialize_node,
    validate_node,
    with_upstream_aliases,
    worker_names,
    worker_raw_config,
)
from kserve_trio.node._devices import (
    Machine,
    check_devices,
    cpu_threads,
    cpu_workers,
    detect_devices,
    node_backend,
)
from kserve_trio.node._restart import max_restarts
from kserve_trio.node._threads import (
    affinity_mode,
    cpu_slices,
    format_cpus,
    frontend_processes,
    gateway_processes,
    thread_env,
    worker_threads,
)

ROLE_ENV = "KSERVE_TRIO_ROLE"
GATEWAY_ENV_PREFIX = "KSERVE_TRIO_GATEWAY_"
GATEWAY_FILE_ENV = GATEWAY_ENV_PREFIX + "FILE"
LISTEN_GRPC_ENV = GATEWAY_ENV_PREFIX + "LISTEN_GRPC"
LISTEN_METRICS_ENV = GATEWAY_ENV_PREFIX + "LISTEN_METRICS"
LISTEN_HTTP_ENV = GATEWAY_ENV_PREFIX + "LISTEN_HTTP"
DEFAULT_LISTEN_GRPC = "0.0.0.0:8001"
DEFAULT_LISTEN_METRICS = "0.0.0.0:8002"
WORKER_GRACE_SECONDS = 15.0
GATEWAY_GRACE_SECONDS = 10.0

PORT_ENV = ENV_PREFIX + "ENDPOINTS_PORT"
METRICS_PORT_ENV = ENV_PREFIX + "ENDPOINTS_METRICS_PORT"
HTTP_PORT_ENV = ENV_PREFIX + "ENDPOINTS_HTTP_PORT"
HOST_ENV = ENV_PREFIX + "ENDPOINTS_HOST"
FRONTEND_PROCESSES_ENV = ENV_PREFIX + "ENDPOINTS_FRONTEND_PROCESSES"
PER_WORKER_ENV = (
    PORT_ENV,
    METRICS_PORT_ENV,
    HTTP_PORT_ENV,
    ENV_PREFIX + "RUNTIME_DEVICE_ORDINAL",
)
"""Worker settings the node assigns per worker; inherited values would give every worker the
same one, so they are not passed on."""

_UNBUFFERED = {"PYTHONUNBUFFERED": "1"}
"""Children write through at once (unless the environment says otherwise): their lines reach
the node's log as they happen and are not lost in a buffer when a child is killed."""

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}


@dataclass(frozen=True)
class ChildSpec:
    """One supervised process: what runs, with which environment, how long it may take to
    stop, which CPUs it is pinned to, and where its gRPC server listens (``None``: unknown)."""

    name: str
    kind: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    grace: float
    cpus: tuple[int, ...] | None = None
    address: tuple[str, int] | None = None


@dataclass(frozen=True)
class GatewaySource:
    """Where the embedded gateway's configuration comes from.

    ``origin`` is ``file`` (``--gateway FILE`` / ``KSERVE_TRIO_GATEWAY_FILE``), ``node`` (the
    node's ``gateway:`` block, written to ``path`` for the gateway to read) or ``env``
    (environment only). ``raw`` is the file's or block's contents.
    """

    origin: str = "env"
    path: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodePlan:
    """Everything the supervisor will do. ``node`` is the materialized node the children read
    from ``node_file``; ``gateway_block`` is the node's ``gateway:`` block to write to
    ``gateway_file`` (or ``None``)."""

    role: str
    children: tuple[ChildSpec, ...]
    node: Mapping[str, Any] | None = None
    node_file: str | None = None
    gateway_block: Mapping[str, Any] | None = None
    gateway_file: str | None = None
    public_grpc: tuple[str, int] | None = None
    public_metrics: tuple[str, int] | None = None
    public_http: tuple[str, int] | None = None
    threads: int | None = None
    max_restarts: int = 0
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def child(self, name: str) -> ChildSpec:
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def workers(self) -> tuple[ChildSpec, ...]:
        return tuple(c for c in self.children if c.kind == "worker")


def resolve_role(role: str | None, env: Mapping[str, str], node: Mapping[str, Any] | None) -> str:
    """The keyword, else ``KSERVE_TRIO_ROLE``, else the node's ``role:``, else ``all``."""
    if role is not None:
        value, where = role, "role"
    elif env.get(ROLE_ENV, "").strip():
        value, where = env[ROLE_ENV], ROLE_ENV
    elif node is not None and node.get("role") is not None:
        value, where = node["role"], "node config 'role'"
    else:
        return "all"
    token = value.strip().lower() if isinstance(value, str) else None
    if token not in ROLES:
        raise ConfigError(f"{where} must be one of {', '.join(ROLES)} (got {value!r})")
    return token


def parse_listen(text: str, where: str) -> tuple[str, int]:
    """A listen address ``host:port`` (``[v6]:port``; an empty host is every interface)."""
    value = text.strip()
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{where} must be 'host:port' (got {text!r})")
    return host or "0.0.0.0", int(port_text)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_host(host: str) -> str:
    """Where to connect to reach a server bound on ``host`` (a wildcard means loopback)."""
    return _WILDCARDS.get(host, host)


def public_listen(
    env: Mapping[str, str], source: GatewaySource
) -> tuple[tuple[str, int], tuple[str, int]]:
    """The node's public gRPC and metrics addresses: ``KSERVE_TRIO_GATEWAY_LISTEN_*``, else the
    gateway configuration's ``listen:``, else ``0.0.0.0:8001`` / ``0.0.0.0:8002``."""
    listen = source.raw.get("listen")
    listen = listen if isinstance(listen, Mapping) else {}
    out = []
    for var, key, default in (
        (LISTEN_GRPC_ENV, "grpc", DEFAULT_LISTEN_GRPC),
        (LISTEN_METRICS_ENV, "metrics", DEFAULT_LISTEN_METRICS),
    ):
        if env.get(var, "").strip():
            out.append(parse_listen(env[var], var))
        elif isinstance(listen.get(key), str):
            out.append(parse_listen(listen[key], f"gateway config 'listen.{key}'"))
        else:
            out.append(parse_listen(default, var))
    return out[0], out[1]


def public_http(env: Mapping[str, str], source: GatewaySource) -> tuple[str, int] | None:
    """The node's public KServe REST address: ``KSERVE_TRIO_GATEWAY_LISTEN_HTTP``, else the
    gateway configuration's ``listen.http``, else none (REST off)."""
    if env.get(LISTEN_HTTP_ENV, "").strip():
        return parse_listen(env[LISTEN_HTTP_ENV], LISTEN_HTTP_ENV)
    listen = source.raw.get("listen")
    text = listen.get("http") if isinstance(listen, Mapping) else None
    if isinstance(text, str) and text.strip():
        return parse_listen(text, "gateway config 'listen.http'")
    return None


@dataclass(frozen=True)
class WorkerAddress:
    """Where one worker serves, as the gateway must reach it."""

    name: str
    host: str
    port: int
    metrics_port: int | None
    http_port: int | None = None


def gateway_launch(
    source: GatewaySource,
    workers: Sequence[WorkerAddress],
    node: Mapping[str, Any] | None,
    env: Mapping[str, str],
    python: str,
    *,
    processes: int = 1,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The embedded gateway's command line and the variables added to its environment.

    Rules:
    1. the command is ``python -m kserve_trio gateway``; a configuration file (explicit, or the
       node's ``gateway:`` block as written) reaches it as ``KSERVE_TRIO_GATEWAY_FILE``;
    2. when that configuration lists no ``endpoints`` (always, for environment only) and
       ``KSERVE_TRIO_GATEWAY_WORKERS`` is unset, the node's workers are synthesized:
       ``..._WORKERS`` (``host:port`` each, wildcards as loopback), ``..._WORKER_NAMES``, and
       ``..._WORKER_METRICS`` when every worker has a metrics port and
       ``..._WORKER_HTTP_ENDPOINTS`` when every worker has a REST port (``http_base_port``),
       so the gateway forwards REST to the workers' own REST ports; a list the
       configuration or the environment already gives is left alone;
    3. ``grpc.max_recv_msg_bytes`` / ``max_send_msg_bytes`` of the node's ``global:`` are
       mirrored as ``..._GRPC_MAX_{RECV,SEND}_MSG_BYTES`` unless the configuration or the
       environment sets them (the gateway then accepts what its workers accept);
    4. ``..._STARTUP_WAIT_SECONDS=inf`` unless set: the workers start alongside the gateway,
       which must wait for them rather than fail fast;
    5. ``..._PROCESSES=<processes>`` when ``processes`` (the node's sizing,
       ``_threads.gateway_processes``) is above 1, unless the configuration's ``processes``
       or the environment sets it.
    """
    argv = (python, "-m", "kserve_trio", "gateway")
    add: dict[str, str] = {}
    if source.path:
        add[GATEWAY_FILE_ENV] = source.path
    raw = source.raw
    g = GATEWAY_ENV_PREFIX
    if workers and "endpoints" not in raw and g + "WORKERS" not in env:
        add[g + "WORKERS"] = ",".join(format_address(connect_host(w.host), w.port) for w in workers)
        if "worker_names" not in raw and g + "WORKER_NAMES" not in env:
            add[g + "WORKER_NAMES"] = ",".join(w.name for w in workers)
        metrics = [w.metrics_port for w in workers if w.metrics_port]
        every_metrics = len(metrics) == len(workers)
        if every_metrics and "worker_metrics" not in raw and g + "WORKER_METRICS" not in env:
            add[g + "WORKER_METRICS"] = ",".join(
                format_address(connect_host(w.host), p)
                for w, p in zip(workers, metrics, strict=True)
            )
        rest = [w.http_port for w in workers if w.http_port]
        every_rest = len(rest) == len(workers)
        if (
            every_rest
            and "worker_http_endpoints" not in raw
            and g + "WORKER_HTTP_ENDPOINTS" not in env
        ):
            add[g + "WORKER_HTTP_ENDPOINTS"] = ",".join(
                format_address(connect_host(w.host), p) for w, p in zip(workers, rest, strict=True)
            )
    glob = (node or {}).get("global") or {}
    node_grpc = glob.get("grpc") if isinstance(glob, Mapping) else None
    raw_grpc = raw.get("grpc")
    if not isinstance(raw_grpc, Mapping):
        raw_grpc = {}
    if isinstance(node_grpc, Mapping):
        for key in ("max_recv_msg_bytes", "max_send_msg_bytes"):
            var = g + "GRPC_" + key.upper()
            if key in node_grpc and key not in raw_grpc and var not in env:
                add[var] = str(node_grpc[key])
    if g + "STARTUP_WAIT_SECONDS" not in env:
        add[g + "STARTUP_WAIT_SECONDS"] = "inf"
    if processes > 1 and "processes" not in raw and g + "PROCESSES" not in env:
        add[g + "PROCESSES"] = str(processes)
    return argv, add


def _worker_config(node: Mapping[str, Any], name: str, env: Mapping[str, str]) -> ServerConfig:
    raw, _ = apply_env_overrides(worker_raw_config(node, name), env)
    try:
        return build_config(raw)
    except ConfigError as exc:
        raise ConfigError(f"node worker '{name}': {exc.message}", exc.path) from None


def _shared_weights_warning(configs: Sequence[ServerConfig]) -> str | None:
    """Two or more GPU workers each caching weights on demand keep private host copies."""
    if len(configs) < 2:
        return None
    private = [
        c
        for c in configs
        if str(c.runtime.backend) != "cpu"
        and c.runtime.weight_cache_fraction > 0
        and not c.runtime.shared_host_weights
    ]
    if len(private) < 2:
        return None
    return (
        f"{len(private)} workers with the on-demand weight cache but "
        "global.runtime.shared_host_weights is off; each worker holds a private host copy of "
        "every model's weights (set shared_host_weights: true to share one copy per node)"
    )


def plan_node(
    node: Mapping[str, Any] | None,
    *,
    role: str | None = None,
    env: Mapping[str, str],
    machine: Machine,
    node_file: str,
    gateway: GatewaySource | None = None,
    python: str,
) -> NodePlan:
    """The plan for this node. Rules, in order:

    1. role: ``resolve_role``; ``gateway`` needs no node file and runs only the gateway, whose
       workers are synthesized from the node's explicit ``workers:`` list when there is one;
    2. devices: ``detect_devices`` (the machine's own only for a non-CPU backend); a CUDA node
       without any is a ConfigError; ``materialize_node`` synthesizes or assigns the workers
       (``KSERVE_TRIO_CPU_WORKERS`` of them on a CPU node), then ``validate_node``;
    3. every worker runs ``python -m kserve_trio worker --node NODE_FILE --worker NAME`` with
       ``KSERVE_TRIO_WORKER_NAME=NAME``, ``CUDA_VISIBLE_DEVICES`` = its device (empty for a CPU
       worker, never inherited), the thread budget's variables and CPUs (``_threads``) and,
       from the same budget, ``INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES`` when it is above
       1 and the worker's configuration leaves the key at 1; the
       node-assigned ``INFERENCE_SERVER_ENDPOINTS_PORT`` / ``_METRICS_PORT`` /
       ``_RUNTIME_DEVICE_ORDINAL`` are not inherited (a warning says so);
    4. role ``all`` with exactly one worker: that worker serves the public addresses itself
       (``INFERENCE_SERVER_ENDPOINTS_HOST``/``_PORT``/``_METRICS_PORT`` from
       ``public_listen``, ``_HTTP_PORT`` from ``public_http`` when REST is on) and no gateway
       runs; with two or more the gateway child is added
       (``gateway_launch``) and a worker port equal to a public port is warned about; every
       child gets ``PYTHONUNBUFFERED=1`` unless the environment sets it;
    5. advisory warnings: unused devices, private host weight copies, unpinned workers.

    Upstream ``REACTANT_*`` names are read as their new names first (``core.process.upstream_env``),
    and the children inherit only the new names.
    """
    env = with_upstream_aliases(env)
    role = resolve_role(role, env, node)
    source = gateway if gateway is not None else GatewaySource()
    notes: list[str] = []
    warnings: list[str] = []
    restarts = max_restarts(env)
    base_env = dict(env)

    if role == "gateway":
        return _gateway_only(node, source, env, python, restarts)
    if node is None:
        raise ConfigError(f"role '{role}' needs a node file")
    node = copy.deepcopy(dict(node))
    backend = node_backend(node, env)
    detected = detect_devices(node, env, machine, auto_detect=backend != "cpu")
    check_devices(backend, detected.devices)
    selectors = materialize_node(node, detected.devices, cpu_workers(env))
    validate_node(node)
    names = worker_names(node)
    n = len(names)
    if detected.devices:
        notes.append(f"devices: {', '.join(detected.devices)} (from {detected.source})")
        unused = len(detected.devices) - sum(1 for s in selectors if s is not None)
        if unused:
            notes.append(f"{unused} visible device(s) left unused")
    else:
        notes.append(f"CPU node: {n} worker(s)")

    for var in PER_WORKER_ENV:
        if var in base_env:
            warnings.append(
                f"{var} is set in the environment; the node assigns it per worker, "
                "so it is not passed to the workers"
            )
            del base_env[var]
    configs = [_worker_config(node, name, base_env) for name in names]

    allowed = list(machine.allowed_cpus())
    cpus = cpu_threads(allowed, machine.cpu_quota())
    threads = worker_threads(cpus, n, env)
    mode = affinity_mode(env)
    slices = cpu_slices(allowed, n, threads, mode)
    pinned = ", ".join(
        f"{name} on cpus {format_cpus(s)}" for name, s in zip(names, slices, strict=True) if s
    )
    notes.append(
        f"each worker: {threads} compute thread(s) + 1 interactive"
        + (f"; {pinned}" if pinned else "")
    )
    if mode == "auto" and n >= 2 and not pinned:
        warnings.append(
            f"workers not pinned to CPUs: {n} x {threads} thread(s) exceed the "
            f"{len(allowed)} CPU(s) available"
        )

    single = role == "all" and n == 1
    grpc_addr = metrics_addr = http_addr = None
    if role == "all":
        grpc_addr, metrics_addr = public_listen(env, source)
        http_addr = public_http(env, source)

    children: list[ChildSpec] = []
    addresses = []
    for i, name in enumerate(names):
        e = configs[i].endpoints
        host, port, mport = e.host, e.port, e.metrics_port or None
        extra: dict[str, str] = {}
        if single:
            assert grpc_addr is not None and metrics_addr is not None
            host, port, mport = grpc_addr[0], grpc_addr[1], metrics_addr[1] or None
            extra = {HOST_ENV: host, PORT_ENV: str(port), METRICS_PORT_ENV: str(metrics_addr[1])}
            if metrics_addr[1] and metrics_addr[0] != host:
                warnings.append(
                    f"single worker binds one host: metrics served on {host}, not {metrics_addr[0]}"
                )
            metrics_text = f" / {format_address(host, metrics_addr[1])} (metrics)"
            http_text = ""
            if http_addr is not None:
                extra[HTTP_PORT_ENV] = str(http_addr[1])
                http_text = f" / {format_address(host, http_addr[1])} (REST)"
                if http_addr[0] != host:
                    warnings.append(
                        f"single worker binds one host: REST served on {host}, not {http_addr[0]}"
                    )
            notes.append(
                f"single worker: serving directly on {format_address(host, port)} (gRPC)"
                + (metrics_text if metrics_addr[1] else "")
                + http_text
                + "; no gateway"
            )
        front_ends = frontend_processes(threads)
        if (
            front_ends > 1
            and configs[i].endpoints.frontend_processes == 1
            and FRONTEND_PROCESSES_ENV not in base_env
        ):
            extra[FRONTEND_PROCESSES_ENV] = str(front_ends)
        child_env = {
            **_UNBUFFERED,
            **base_env,
            **thread_env(threads, base_env.get("XLA_FLAGS", "")),
            **extra,
            WORKER_NAME_ENV: name,
            "CUDA_VISIBLE_DEVICES": selectors[i] or "",
        }
        argv = (python, "-m", "kserve_trio", "worker", "--node", node_file, "--worker", name)
        children.append(
            ChildSpec(
                name, "worker", argv, child_env, WORKER_GRACE_SECONDS, slices[i], (host, port)
            )
        )
        addresses.append(WorkerAddress(name, host, port, mport, e.http_port or None))

    if role == "all" and n >= 2:
        assert grpc_addr is not None and metrics_addr is not None
        public = {grpc_addr[1]: "public gRPC", metrics_addr[1]: "public metrics"}
        if http_addr is not None:
            public[http_addr[1]] = "public REST"
        for a, cfg in zip(addresses, configs, strict=True):
            for p in (a.port, a.metrics_port, cfg.endpoints.http_port):
                if p and p in public:
                    warnings.append(
                        f"worker '{a.name}' port {p} collides with the gateway's {public[p]} port"
                    )
        sized = gateway_processes(cpus, n)
        spec = _gateway_child(source, addresses, node, base_env, python, grpc_addr, sized)
        children.append(spec)
        if GATEWAY_ENV_PREFIX + "PROCESSES" in spec.env.keys() - base_env.keys():
            notes.append(
                f"embedded gateway: {sized} processes (one per worker, at most one per "
                "4 CPUs; set gateway.processes or KSERVE_TRIO_GATEWAY_PROCESSES to override)"
            )
        notes.append(f"embedded gateway on {format_address(*grpc_addr)} ({_gateway_note(source)})")

    advice = _shared_weights_warning(configs)
    if advice:
        warnings.append(advice)
    uses_block = role == "all" and n >= 2 and source.origin == "node"
    return NodePlan(
        role=role,
        children=tuple(children),
        node=node,
        node_file=node_file,
        gateway_block=source.raw if uses_block else None,
        gateway_file=source.path if uses_block else None,
        public_grpc=grpc_addr,
        public_metrics=metrics_addr,
        public_http=http_addr,
        threads=threads,
        max_restarts=restarts,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )


def _gateway_only(
    node: Mapping[str, Any] | None,
    source: GatewaySource,
    env: Mapping[str, str],
    python: str,
    restarts: int,
) -> NodePlan:
    """Role ``gateway``: the gateway child alone, pointed at the node's explicit workers."""
    addresses: list[WorkerAddress] = []
    if node is not None and isinstance(node.get("workers"), list):
        validate_node(dict(node))
        for name in worker_names(node):
            e = _worker_config(node, name, env).endpoints
            addresses.append(
                WorkerAddress(name, e.host, e.port, e.metrics_port or None, e.http_port or None)
            )
    grpc_addr, metrics_addr = public_listen(env, source)
    from_block = source.origin == "node"
    return NodePlan(
        role="gateway",
        children=(_gateway_child(source, addresses, node, env, python, grpc_addr),),
        gateway_block=source.raw if from_block else None,
        gateway_file=source.path if from_block else None,
        public_grpc=grpc_addr,
        public_metrics=metrics_addr,
        public_http=public_http(env, source),
        max_restarts=restarts,
        notes=(f"role=gateway: workers run elsewhere ({_gateway_note(source)})",),
    )


def _gateway_note(source: GatewaySource) -> str:
    if source.origin == "file":
        return f"configured from {source.path}"
    if source.origin == "node":
        return "configured from the node's gateway: block"
    return "configured from the environment"


def _gateway_child(
    source: GatewaySource,
    addresses: Sequence[WorkerAddress],
    node: Mapping[str, Any] | None,
    env: Mapping[str, str],
    python: str,
    grpc_addr: tuple[str, int],
    processes: int = 1,
) -> ChildSpec:
    argv, add = gateway_launch(source, addresses, node, env, python, processes=processes)
    child_env = {**_UNBUFFERED, **env, **add, "CUDA_VISIBLE_DEVICES": ""}
    if source.path is None:
        child_env.pop(GATEWAY_FILE_ENV, None)
    return ChildSpec("gateway", "gateway", argv, child_env, GATEWAY_GRACE_SECONDS, None, grpc_addr)


__all__ = [
    "DEFAULT_LISTEN_GRPC",
    "DEFAULT_LISTEN_METRICS",
    "GATEWAY_FILE_ENV",
    "GATEWAY_GRACE_SECONDS",
    "LISTEN_GRPC_ENV",
    "LISTEN_HTTP_ENV",
    "LISTEN_METRICS_ENV",
    "PER_WORKER_ENV",
    "ROLE_ENV",
    "WORKER_GRACE_SECONDS",
    "ChildSpec",
    "GatewaySource",
    "NodePlan",
    "WorkerAddress",
    "connect_host",
    "format_address",
    "gateway_launch",
    "parse_listen",
    "plan_node",
    "public_http",
    "public_listen",
    "resolve_role",
]
