"""The weight cache's I/O edge: where one model's weights live and how they move.

A managed model (``Record``) has up to two tiers besides its weights file: the host tier (host
arrays materialised once through a ``WeightStore``, private or shared by the node's workers) and
the device tier (the model's own device buffers, ``ManagedModel.load_weights`` /
``free_weights``). ``Tiers`` performs the moves between file, host and device, and reads the
backend's memory figures. It decides nothing: which model moves when, and what the budget says,
is the driver's (``kserve_trio.runtime.weight_cache.WeightCache``), and the arithmetic is
``kserve_trio.runtime._budget``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import ResidencyState
from kserve_trio.runtime.weight_store import WeightStore, weights_digest, weights_file_token
from kserve_trio.runtime.weights import WeightsIndex

log = get_logger("kserve_trio.runtime.weight_cache")


class DeviceMemory(Protocol):
    """What the cache needs from a backend: memory figures and the probe's input transfer
    (``JaxBackend`` is one)."""

    def memory_stats(self) -> Mapping[str, int]: ...

    def memory_in_use(self) -> int: ...

    def transfer_to_device(self, hosts: Sequence[np.ndarray]) -> list[Any]: ...


@runtime_checkable
class ManagedModel(Protocol):
    """The residency surface of a compiled model (``CompiledModel`` is one): its weights file
    and its device buffers. Runtime-checkable so that a model handed to the cache can be
    checked once, when it is admitted."""

    name: str
    weight_nbytes: int
    weights: WeightsIndex

    def weights_resident(self) -> bool: ...

    def load_weights(self, hosts: Sequence[np.ndarray] | None = None) -> None: ...

    def free_weights(self) -> None: ...


@dataclass(eq=False)
class Record:
    """A model the cache manages; ``host`` is its host tier (None when not materialised)."""

    name: str
    entry: ManagedModel
    nbytes: int
    floor: ResidencyState
    host: list[np.ndarray] | None = None


class Tiers:
    """The moves of a model's weights between its file, the host store and the device."""

    def __init__(self, backend: DeviceMemory, store: WeightStore) -> None:
        self.backend = backend
        self.store = store

    def memory_stats(self) -> dict[str, int]:
        """The backend's memory figures; empty when it reports none."""
        try:
            return dict(self.backend.memory_stats())
        except Exception:
            return {}

    def in_use(self) -> int:
        """Device bytes in use now (from ``bytes_in_use`` when the backend has no direct
        reading)."""
        try:
            return int(self.backend.memory_in_use())
        except Exception:
            return int(self.memory_stats().get("bytes_in_use", 0))

    def file_arrays(self, rec: Record) -> list[np.ndarray]:
        """The weights read from the model's file (memory-mapped views)."""
        log.debug("weights_file_read", model=rec.name, path=str(rec.entry.weights.path))
        return rec.entry.weights.host_arrays()

    def load(self, rec: Record) -> None:
        """Device copy from the host tier, else from the weights file (no counters)."""
        hosts = rec.host if rec.host is not None else self.file_arrays(rec)
        rec.entry.load_weights(hosts)

    def materialize(self, rec: Record) -> None:
        """Build the host tier through the store (reads the file only when this worker is
        the one that must fill it)."""
        entries = rec.entry.weights.entries
        specs = [(e.dtype.numpy, e.shape) for e in entries]
        digest = weights_digest(rec.name, specs, content=weights_file_token(rec.entry.weights.path))

        def fill(arrays: list[np.ndarray]) -> None:
            for dst, src in zip(arrays, self.file_arrays(rec), strict=True):
                np.copyto(dst, src)

        rec.host = self.store.materialize(rec.name, digest, specs, fill)

    def drop_host(self, rec: Record) -> None:
        """Release the host tier (the store frees a shared region with its last user)."""
        rec.host = None
        self.store.release(rec.name)


__all__ = ["DeviceMemory", "ManagedModel", "Record", "Tiers"]
