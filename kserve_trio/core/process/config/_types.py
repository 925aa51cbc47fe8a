"""The worker configuration's value types: the ``ServerConfig`` family of frozen dataclasses,
its enums (and ``FrozenMap``, from ``_frozen``) and the value coercions the dataclasses apply
to themselves.

The dataclass field defaults *are* the YAML defaults, so a config built in code, from YAML or
from the command line starts from the same values.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.memory import ClientShmPolicy
from kserve_trio.core.process.config._frozen import FrozenMap
from kserve_trio.core.process.config._limits import EdgeLimits
from kserve_trio.core.process.config._tracing import TracingConfig
from kserve_trio.http2 import DEFAULT_ENGINE

DEFAULT_GRPC_MSG_BYTES = 512 << 20
"""gRPC message cap in each direction (a decode/encode bound, not an allocation)."""

LIVENESS_INTERVAL_SECONDS = 1.0
"""How often a supervisor asks each of its serving processes (a worker's front ends, a
gateway's children) for a liveness answer, and how long that answer may take."""
LIVENESS_MISSES = 3
"""Consecutive unanswered liveness probes after which a serving process is killed (0: never)."""

ENV_PREFIX = "INFERENCE_SERVER_"
WORKER_NAME_ENV = "KSERVE_TRIO_WORKER_NAME"


class ModelControlMode(enum.Enum):
    """How the set of loaded models changes over a worker's life (Triton's model-control-mode)."""

    STATIC = "static"
    DYNAMIC = "dynamic"
    EXPLICIT = "explicit"


class SchedulingDiscipline(enum.Enum):
    """Inter-model dispatch ordering; coalescing runs underneath all three."""

    FAIR = "fair"
    FIFO = "fifo"
    EDF = "edf"


class NumericsMode(enum.Enum):
    """f32 matmul/convolution precision policy (``runtime.numerics``)."""

    AUTO = "auto"
    F32 = "f32"
    TF32 = "tf32"


class ResidencyState(enum.IntEnum):
    """A model's weight-residency floor; same numbers as the control proto's enum."""

    UNPINNED = 1
    PINNED_SYSTEM = 2
    PINNED_DEVICE = 3


class ResidencyMode(enum.Enum):
    """Who owns device residency; derived from ``ModelControlMode`` (explicit -> external)."""

    SELF_MANAGED = "self_managed"
    EXTERNALLY_MANAGED = "externally_managed"


_BACKENDS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda"}


def parse_enum(cls: type[enum.Enum], value: Any, path: str) -> Any:
    """Accept an enum member or its (case-insensitive, trimmed) value string."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.strip().lower():
                return member
    choices = ", ".join(f"'{m.value}'" for m in cls)
    raise ConfigError(f"must be one of {choices} (got {value!r})", path)


def parse_backend(value: Any, path: str = "runtime.backend") -> str:
    """``cpu``/``cuda`` (any case, trimmed; ``gpu`` is an alias of ``cuda``)."""
    name = value.strip().lower() if isinstance(value, str) else None
    if name not in _BACKENDS:
        raise ConfigError(f"must be 'cpu' or 'cuda' ('gpu' is an alias) (got {value!r})", path)
    return _BACKENDS[name]


def parse_octal_mode(value: Any, path: str = "runtime.shared_host_weights_mode") -> int:
    """An octal permission string such as ``"660"`` -> ``0o660`` (at most ``0o777``)."""
    try:
        mode = int(value.strip(), 8)
    except (AttributeError, ValueError):
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ConfigError(
            f'must be an octal permission string like "666" or "660" (got {value!r})', path
        )
    return mode


@dataclass(frozen=True)
class RuntimeConfig:
    """Device and runtime settings (the ``runtime:`` block).

    ``cpu_device_memory_bytes`` is the device-memory size the CPU backend reports to the weight
    cache (0 = none), so on-demand residency can be exercised without a GPU. ``autotune_cache``
    ``None`` and ``autotune_cache_dir`` ``""`` mean "inherit the compiler's own setting".
    """

    backend: str = "cpu"
    device_ordinal: int = 0
    mem_fraction: float = 0.9
    preallocate: bool = True
    allow_cpu_fallback: bool = True
    shared_host_weights: bool = False
    shared_host_weights_mode: int = 0o666
    weight_cache_fraction: float = 1.0
    weight_cache_wiggle_fraction: float = 0.1
    autotune: bool = True
    autotune_cache: bool | None = None
    autotune_cache_dir: str = ""
    numerics: NumericsMode = NumericsMode.AUTO
    cpu_device_memory_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", parse_backend(self.backend))
        object.__setattr__(
            self, "numerics", parse_enum(NumericsMode, self.numerics, "runtime.numerics")
        )


@dataclass(frozen=True)
class ModelSchedConfig:
    """Per-model scheduler overrides (``scheduler.models.<name>``).

    ``residency`` ``None`` is resolved by the server at startup (PINNED_SYSTEM with the weight
    cache on, UNPINNED otherwise); ``max_batch_size`` ``None`` means uncapped coalescing.
    """

    weight: float = 1.0
    residency: ResidencyState | None = None
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.residency is not None and not isinstance(self.residency, ResidencyState):
            object.__setattr__(self, "residency", ResidencyState(self.residency))


@dataclass(frozen=True)
class SchedulerConfig:
    """Global scheduler settings (the ``scheduler:`` block); ``models`` holds per-model blocks.

    ``dispatch_timeout_seconds`` (0 = off) bounds a request's execution wait and is enforced by
    the scheduler; ``compaction_interval`` compacts every N on-demand loads (0 = off).
    """

    discipline: SchedulingDiscipline = SchedulingDiscipline.FAIR
    ema_halflife_seconds: float = 30.0
    recency_penalty_cap: float = 0.25
    coalescing_discount: float = 0.1
    cost_ema_alpha: float = 0.2
    max_queue_depth: int = 1024
    dispatch_timeout_seconds: float = 30.0
    compaction_interval: int = 0
    models: Mapping[str, ModelSchedConfig] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        discipline = parse_enum(SchedulingDiscipline, self.discipline, "scheduler.discipline")
        object.__setattr__(self, "discipline", discipline)
        if not isinstance(self.models, FrozenMap):
            object.__setattr__(self, "models", FrozenMap(self.models))


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gRPC endpoint (``endpoints.tls``): PEM files of the server's certificate chain
    and private key (both or neither; neither = plaintext), and optionally a CA bundle that
    client certificates must chain to (mutual TLS: a client without one is refused)."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    @property
    def logged(self) -> str | bool:
        """What the ``*_up`` log lines say of it: ``"mutual"``, else whether TLS is on."""
        return "mutual" if self.mutual else self.enabled


@dataclass(frozen=True)
class EndpointsConfig:
    """Listen addresses; port 0 binds an ephemeral port, ``metrics_port`` 0 disables metrics,
    ``http_port`` 0 disables the KServe V2 REST endpoint, ``max_concurrent_requests`` 0 means
    uncapped; ``tls`` secures the gRPC and REST ports; ``event_loop`` is what the servers run on
    (``uvloop``, ``asyncio`` or ``trio``; empty: uvloop when installed, else asyncio);
    ``restricted_protocols`` lists ``group[,group...]:key=value`` restrictions (Triton's
    ``--grpc-restricted-protocol``; ``core.process.restricted``), gRPC and REST alike; none by default.
    ``frontend_processes`` > 1 serves the gRPC and REST ports from that many front-end
    processes that hand every request to this one, which keeps the device (1: this process
    serves them itself); each front end answers the device process's liveness ping every
    ``frontend_liveness_interval_seconds``, and one that misses ``frontend_liveness_misses`` in
    a row (0: never) is killed and restarted (``worker.frontends``). ``http2_engine`` is the HTTP/2 engine under the gRPC port (``ngh2``,
    libnghttp2, the default; ``h2``, pure Python, the fallback). ``client_shared_memory`` false
    turns the system shared-memory RPCs off (UNAVAILABLE; ``IsSameIPCNamespace`` answers no, so
    clients send tensors inline); a non-empty ``client_shared_memory_prefixes`` allows only keys
    with one of those starts (``core.memory.shm_names.ClientShmPolicy``; reserved keys are refused
    whatever it says)."""

    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int = 0
    max_concurrent_requests: int = 64
    tls: TlsConfig = TlsConfig()
    http_port: int = 0
    event_loop: str = ""
    restricted_protocols: tuple[str, ...] = ()
    frontend_processes: int = 1
    frontend_liveness_interval_seconds: float = LIVENESS_INTERVAL_SECONDS
    frontend_liveness_misses: int = LIVENESS_MISSES
    http2_engine: str = DEFAULT_ENGINE
    client_shared_memory: bool = True
    client_shared_memory_prefixes: tuple[str, ...] = ()

    @property
    def shm_policy(self) -> ClientShmPolicy:
        """What these endpoints let clients do with shared memory, named by these keys."""
        return ClientShmPolicy(
            self.client_shared_memory,
            self.client_shared_memory_prefixes,
            "endpoints.client_shared_memory",
        )


@dataclass(frozen=True)
class GrpcConfig:
    """gRPC message-size caps in each direction (on the decompressed size), and whether every
    reply is compressed (``compress_responses``; by default a reply is compressed only when its
    request was)."""

    max_recv_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_send_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    compress_responses: bool = False


@dataclass(frozen=True)
class MetaConfig:
    """The meta models' scratch buffer pool (``meta:`` block; ``KSERVE_TRIO_FANOUT_*`` env).

    Either value ``<= 0`` disables the pool (sub-calls then allocate their own buffers).
    """

    fanout_bytes: int = 1 << 30
    fanout_slots: int = 16

    @property
    def pool_enabled(self) -> bool:
        return self.fanout_bytes > 0 and self.fanout_slots > 0


@dataclass(frozen=True)
class ServerConfig:
    """The fully resolved configuration of one worker process, frozen for its lifetime.

    ``worker_name`` is the node worker entry it was resolved for ("" when none); it is not a
    YAML key. A non-empty ``cache_dir`` enables JAX's persistent compilation cache there.
    ``serve_without_hooks`` serves a bundle whose hooks are only in the Julia server's
    ``model.jl`` without them, for every bundle (off: such a bundle is refused, so a model whose
    hooks change its tensors never answers wrongly without anyone saying so).
    """

    model_dirs: tuple[str, ...] = ("models",)
    cache_dir: str = ""
    models_include: tuple[str, ...] = ()
    model_control_mode: ModelControlMode = ModelControlMode.DYNAMIC
    model_poll_seconds: float = 15.0
    runtime: RuntimeConfig = RuntimeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    grpc: GrpcConfig = GrpcConfig()
    worker_name: str = ""
    meta: MetaConfig = MetaConfig()
    serve_without_hooks: bool = False
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        for name in ("model_dirs", "models_include"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        mode = parse_enum(ModelControlMode, self.model_control_mode, "model_control_mode")
        object.__setattr__(self, "model_control_mode", mode)

    @property
    def residency_mode(self) -> ResidencyMode:
        """EXPLICIT control cedes residency to a control plane; the others self-manage."""
        if self.model_control_mode is ModelControlMode.EXPLICIT:
            return ResidencyMode.EXTERNALLY_MANAGED
        return ResidencyMode.SELF_MANAGED

    def model_sched(self, name: str) -> ModelSchedConfig:
        """The model's scheduler block, or the defaults when it has none."""
        return self.scheduler.models.get(name, ModelSchedConfig())
