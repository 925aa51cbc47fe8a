"""The codec's boundary types: what a caller names (a requested output, a shared-memory
range) and what the codec needs from a shared-memory registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

BUNDLE_VERSION = "1"
"""The one version every bundle is served as: requests may name it or leave the version empty."""


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A byte range of a registered shared-memory region (offset relative to the region)."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the caller asked for; ``shm`` says where to write it instead of inline."""

    name: str
    shm: ShmRef | None = None


class ShmRegistryLike(Protocol):
    """What the codec needs from a shared-memory registry (implemented by ``core/memory/shm.py``)."""

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        """A zero-copy view of ``byte_size`` bytes at ``offset`` and the callback that releases
        the lease on it. Raises ``UnregisteredRegionError`` or ``InvalidArgument``."""
        ...

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy ``data`` into the region at ``offset``. Raises ``UnregisteredRegionError``; the
        caller has already checked the size against what the client asked for."""
        ...
