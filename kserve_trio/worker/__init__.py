"""The worker: one process serving a model repository over KServe V2 gRPC on one device.

Public surface: ``serve``, ``serve_worker``, ``stop``, ``RunningServer``, ``register_model``,
``register_meta_model``, ``register_heartbeat``, ``register_serve_guard``. Importing this package does not import jax; compiling bundles does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kserve_trio.worker.heartbeat import register_heartbeat, register_serve_guard
from kserve_trio.worker.hooks import register_meta_model, register_model

if TYPE_CHECKING:  # loaded on first use by __getattr__ below; named here for type checkers
    from kserve_trio.worker.server import RunningServer, serve, serve_worker, stop

__all__ = [
    "RunningServer",
    "register_heartbeat",
    "register_meta_model",
    "register_model",
    "register_serve_guard",
    "serve",
    "serve_worker",
    "stop",
]


def __getattr__(name: str):
    if name in ("RunningServer", "serve", "serve_worker", "stop"):
        from kserve_trio.worker import server

        return getattr(server, name)
    raise AttributeError(name)
