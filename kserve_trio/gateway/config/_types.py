"""The configuration's types: the enums, the frozen dataclasses (whose defaults are the
``gateway.yml`` defaults) and the constants the other parts share."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kserve_trio.core.memory import ClientShmPolicy
from kserve_trio.core.process import (
    DEFAULT_GRPC_MSG_BYTES,
    LIVENESS_INTERVAL_SECONDS,
    LIVENESS_MISSES,
    EdgeLimits,
    FrozenMap,
    TlsConfig,
    TracingConfig,
    parse_enum,
)
from kserve_trio.gateway.addresses import parse_host_port
from kserve_trio.http2 import DEFAULT_ENGINE

ENV_PREFIX = "KSERVE_TRIO_GATEWAY_"
FILE_ENV = "KSERVE_TRIO_GATEWAY_FILE"
"""The ``gateway.yml`` path when ``--config`` is not given (unset: environment only)."""

NO_ENDPOINTS = (
    "gateway has no endpoints; set 'endpoints:' in gateway.yml or KSERVE_TRIO_GATEWAY_WORKERS"
)
MAX_PROCESSES = 256
"""The most gateway processes one gateway may run (``processes``)."""
ALL_REPLICAS = -1
"""``replicas`` / ``default_replicas`` value meaning "every ready worker" (YAML ``"all"``)."""


class FillMode(enum.Enum):
    """How lpt_packing picks among a multi-replica model's replicas (``routing_fill_mode``;
    the fill plans in ``gateway.placement.fill`` say what each does)."""

    RUN = "run"
    SPREAD = "spread"
    INFLIGHT = "inflight"


class FillPolicy(enum.Enum):
    """lpt_packing's tie-break between replicas (``routing_policy``): the least loaded worker
    first, or a plain rotation."""

    FILL_LEAST = "fill_least"
    FILL_RR = "fill_rr"


class SchedulingMode(enum.Enum):
    """How the gateway picks a replica for each request."""

    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    LPT_PACKING = "lpt_packing"


class CompactionMode(enum.Enum):
    """What lpt_packing asks of a worker whose assigned models changed at a repack: nothing
    (``off``), free its on-demand weights (``eager``), or free them and load its newly assigned
    models at once (``scheduled``)."""

    OFF = "off"
    EAGER = "eager"
    SCHEDULED = "scheduled"


class WorkBasis(enum.Enum):
    """What ``least_outstanding`` counts as a worker's outstanding work: requests, batch items,
    or estimated compute seconds (items times the model's measured cost per item)."""

    COMPUTE = "compute"
    ITEMS = "items"
    REQUESTS = "requests"


LOG_FORMATS = ("auto", "json", "console")


@dataclass(frozen=True)
class ListenConfig:
    """The gateway's own addresses (``listen:``): the KServe gRPC port, the admin HTTP port
    (``/metrics``, ``/healthz``, ``/readyz``, ``/routing``) and the KServe V2 REST port
    (``http``; empty = off). Port 0 binds an ephemeral port."""

    grpc: str = "0.0.0.0:8001"
    metrics: str = "0.0.0.0:8002"
    http: str = ""

    @property
    def http_address(self) -> tuple[str, int] | None:
        return parse_host_port(self.http, allow_port_zero=True) if self.http else None

    @property
    def grpc_address(self) -> tuple[str, int]:
        return parse_host_port(self.grpc, allow_port_zero=True)

    @property
    def metrics_address(self) -> tuple[str, int]:
        return parse_host_port(self.metrics, allow_port_zero=True)


@dataclass(frozen=True)
class ModelPlacementConfig:
    """``scheduling.models.<name>`` (lpt_packing): the model's replica count (``None``: inherit
    ``default_replicas``; ``ALL_REPLICAS``: every ready worker), its fill mode (``None``:
    inherit ``routing_fill_mode``) and fill factor (0: inherit ``routing_fill_factor``)."""

    replicas: int | None = None
    fill_mode: FillMode | None = None
    fill_factor: float = 0.0

    @property
    def empty(self) -> bool:
        """Whether every field inherits (such an override is no override)."""
        return self.replicas is None and self.fill_mode is None and self.fill_factor == 0.0


@dataclass(frozen=True)
class SchedulingConfig:
    """``scheduling:``. ``work_basis`` is ``None`` unless set; it may only be set under
    ``least_outstanding`` and ``lpt_packing``, which count compute when it is not (``basis``).

    The other fields configure ``lpt_packing`` (placement by measured load; docs/gateway.md)
    and may only be set in that mode: the compute budgets between repacks (fleet compute
    seconds: the first one after start-up, then every one), the per-worker cap on the fleet's
    placed utilization, the hysteresis that keeps a model where it is, the half-life of the
    rate and cost averages (0: the rebalance budget), the replica count of a model without its
    own, the fill plans of multi-replica models (factor, mode, tie-break policy), the
    compaction after a repack (mode, every how many repacks), whether a model may be placed
    where its weights do not fit, and per-model overrides.
    """

    mode: SchedulingMode = SchedulingMode.ROUND_ROBIN
    work_basis: WorkBasis | None = None
    rebalance_compute_seconds: float = 300.0
    first_rebalance_compute_seconds: float = 60.0
    max_worker_share: float = 0.8
    hysteresis: float = 0.0
    ema_halflife_compute_seconds: float = 0.0
    default_replicas: int = 1
    routing_fill_factor: float = 1.0
    routing_policy: FillPolicy = FillPolicy.FILL_LEAST
    routing_fill_mode: FillMode = FillMode.RUN
    compaction_mode: CompactionMode = CompactionMode.EAGER
    compaction_interval: int = 1
    forbid_memory_oversubscription: bool = True
    models: FrozenMap[ModelPlacementConfig] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_enum(SchedulingMode, self.mode, "scheduling.mode"))
        if self.work_basis is not None:
            basis = parse_enum(WorkBasis, self.work_basis, "scheduling.work_basis")
            object.__setattr__(self, "work_basis", basis)
        for name, cls in (
            ("routing_policy", FillPolicy),
            ("routing_fill_mode", FillMode),
            ("compaction_mode", CompactionMode),
        ):
            value = parse_enum(cls, getattr(self, name), f"scheduling.{name}")
            object.__setattr__(self, name, value)
        if not isinstance(self.models, FrozenMap):
            object.__setattr__(self, "models", FrozenMap(self.models))

    @property
    def halflife(self) -> float:
        """The resolved ``ema_halflife_compute_seconds`` (0 means the rebalance budget)."""
        if self.ema_halflife_compute_seconds > 0:
            return self.ema_halflife_compute_seconds
        return self.rebalance_compute_seconds if self.rebalance_compute_seconds > 0 else 30.0

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
    every request. ``headers`` (``key=value`` entries) go on the gateway's own calls to the
    workers (health and routing probes, placement): the credentials a worker's restricted
    protocols ask for; a call made for a client carries the client's headers instead."""

    request_timeout_seconds: float = 60.0
    max_concurrent_streams: int = 32
    tls: WorkerTlsConfig = WorkerTlsConfig()
    headers: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayGrpcConfig:
    """``grpc:``: message caps in each direction, and the inbound admission cap and queue per
    worker (the gateway admits ``max_concurrent_requests_per_worker`` times the number of
    workers concurrent requests, 0 = uncapped; past it up to ``max_queued_requests_per_worker``
    times the workers wait for a slot within their deadline, and the rest are shed with
    RESOURCE_EXHAUSTED; 0 = no queue). A burst a worker would serve is queued, not shed:
    stock clients do not retry RESOURCE_EXHAUSTED."""

    max_recv_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_send_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_concurrent_requests_per_worker: int = 64
    max_queued_requests_per_worker: int = 256


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
    routing table, routing metadata). ``wedge_exit_rounds``: the gateway's own event loop making
    no progress for this many health intervals (never less than ``watchdog.MIN_LIMIT_SECONDS``)
    means it is wedged, and it exits 1 so its supervisor restarts it (0 = never). Workers that
    stop answering never count: the gateway serves on and takes them back.
    ``hosts_file``: a file in the ``/etc/hosts`` format that the gateway's resolver reads every
    round before asking the system (names it lists resolve to its addresses only); "" = the
    system resolver alone. It lets one name stand for a changing set of addresses without a
    DNS server (tests, and hosts where ``/etc/hosts`` is not the gateway's to edit).
    """

    startup_wait_seconds: float = 0.0
    health_interval_seconds: float = 10.0
    wedge_exit_rounds: int = 3
    hosts_file: str = ""


@dataclass(frozen=True)
class GatewayConfig:
    """The fully resolved configuration of one gateway process, frozen for its lifetime.

    ``endpoints`` are the workers' gRPC addresses (``host:port``; a name that resolves to
    several addresses is several workers). ``worker_metrics`` (optional) and ``worker_names``
    (optional) are index-aligned with ``endpoints``: entry ``i`` is the Prometheus endpoint and
    the label of the workers behind ``endpoints[i]``. ``worker_http_endpoints`` (optional) is
    aligned the same way: entry ``i`` is the KServe V2 REST address of the workers behind
    ``endpoints[i]`` (a name resolves per round, and each worker takes the REST address equal to
    its own), where the gateway forwards REST requests that name a model. ``event_loop`` is
    what the gateway runs on (``uvloop``, ``asyncio`` or ``trio``; empty: uvloop when installed),
    ``http2_engine`` the HTTP/2 engine under its gRPC port (``ngh2`` by default, or ``h2``).
    ``processes`` is how many gateway processes share the public ports (``processes.py``; 1:
    this process serves alone); the parent of several asks each child's ``/healthz`` every
    ``process_liveness_interval_seconds`` and kills one that misses
    ``process_liveness_misses`` in a row (0: never), to be restarted (``processes._children``).
    ``restricted_protocols`` are the gateway's own ``group[,group...]:key=value`` restrictions
    (``core.process.restricted``), on its gRPC and REST ports; none by default.
    ``client_shared_memory`` and ``client_shared_memory_prefixes`` are the worker's switch and
    allow-list of the same names, applied by the gateway before it fans a registration out
    (``shm_policy``).
    """

    listen: ListenConfig = ListenConfig()
    endpoints: tuple[str, ...] = ()
    worker_metrics: tuple[str, ...] = ()
    worker_names: tuple[str, ...] = ()
    worker_http_endpoints: tuple[str, ...] = ()
    scheduling: SchedulingConfig = SchedulingConfig()
    worker_client: WorkerClientConfig = WorkerClientConfig()
    grpc: GatewayGrpcConfig = GatewayGrpcConfig()
    tls: TlsConfig = field(default_factory=TlsConfig)
    logging: LoggingConfig = LoggingConfig()
    prober: ProberConfig = ProberConfig()
    event_loop: str = ""
    http2_engine: str = DEFAULT_ENGINE
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    processes: int = 1
    process_liveness_interval_seconds: float = LIVENESS_INTERVAL_SECONDS
    process_liveness_misses: int = LIVENESS_MISSES
    restricted_protocols: tuple[str, ...] = ()
    client_shared_memory: bool = True
    client_shared_memory_prefixes: tuple[str, ...] = ()

    @property
    def shm_policy(self) -> ClientShmPolicy:
        """What the gateway lets clients do with shared memory, named by its keys."""
        return ClientShmPolicy(
            self.client_shared_memory, self.client_shared_memory_prefixes, "client_shared_memory"
        )

    def __post_init__(self) -> None:
        for name in ("endpoints", "worker_metrics", "worker_names", "worker_http_endpoints"):
            value = getattr(self, name)
            items = (value,) if isinstance(value, str) else tuple(value)
            object.__setattr__(self, name, tuple(item.strip() for item in items))
