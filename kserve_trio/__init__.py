"""kserve_trio: a multi-model KServe V2 gRPC inference server for compiled StableHLO bundles.

The package is layered (``docs/architecture.md``): ``proto`` and ``core`` at the bottom (no jax, no
server code), ``client`` above them, ``runtime``/``export`` (the only jax importers), then
``worker``, ``gateway`` and ``node``. Importing this top-level package imports nothing else.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
