"""Memory: the buffers requests and replies live in, outside the Python heap.

- ``shm``: the server's system shared-memory registry (``ShmRegistry``: client regions
  attached, read for inputs and written for outputs);
- ``shm_names``: the rules for client-supplied region names and POSIX object keys, and the
  names the project reserves for itself;
- ``buffer_pool``: staging buffer pools (fixed-size slots lent in contiguous runs) and
  scratch buffers.

Stands on ``core.tensors``; neither the protocol nor the process domain. The host weight store
is the runtime's (``runtime/weight_store.py``), its one user. Code outside the domain imports
the names below from this face; the modules import each other by module path.
"""

from kserve_trio.core.memory.buffer_pool import (
    BufferPool,
    PoolSlot,
    ScratchBuffer,
    pool_offset,
    pool_view,
    scratch,
    subslot,
)
from kserve_trio.core.memory.shm import ShmRegistry
from kserve_trio.core.memory.shm_names import (
    SHM_DIR,
    ClientShmPolicy,
    check_key,
    prefix_problem,
    reserved_name,
    shown,
)

__all__ = [
    "SHM_DIR",
    "BufferPool",
    "ClientShmPolicy",
    "PoolSlot",
    "ScratchBuffer",
    "ShmRegistry",
    "check_key",
    "pool_offset",
    "pool_view",
    "prefix_problem",
    "reserved_name",
    "scratch",
    "shown",
    "subslot",
]
