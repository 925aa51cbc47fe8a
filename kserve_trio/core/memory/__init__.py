"""Memory: the buffers requests and replies live in, outside the Python heap.

- ``shm``: the server's system shared-memory registry (``ShmRegistry``: client regions
  attached, read for inputs and written for outputs);
- ``shm_names``: the rules for client-supplied region names and POSIX object keys, and the
  names the project reserves for itself;
- ``buffer_pool``: staging buffer pools (fixed-size slots lent in contiguous runs) and
  scratch buffers.

Stands on ``core.tensors``; neither the protocol nor the process domain. The host weight store
is the runtime's (``runtime/weight_store.py``), its one user. The face loads nothing: import
from the modules.
"""
