"""Which engine a process runs: the names, the default, and making one.

The choice is made once per process (the worker's, front end's and gateway's configuration,
the client's argument) and passed down as a name; nothing above the seam branches on it. An
engine's module (and its library) is imported when a first connection asks for it, so a
process loads only the engine it runs, and the layers that only name an engine (configuration)
load none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Literal, get_args

from kserve_trio.http2._engine import Engine, EngineSettings

EngineName = Literal["ngh2", "h2"]
ENGINES: tuple[str, ...] = get_args(EngineName)
DEFAULT_ENGINE: EngineName = "ngh2"
"""libnghttp2: a sixth of h2's CPU per small call (docs/benchmarks.md, "HTTP/2 engines")."""

_IMPLEMENTATIONS = {
    "ngh2": ("kserve_trio.http2._ngh2", "Ngh2Engine"),
    "h2": ("kserve_trio.http2._h2", "H2Engine"),
}
_loaded: dict[str, Callable[[EngineSettings], Engine]] = {}


def check_engine(name: str) -> EngineName:
    """``name`` as an engine name; ValueError naming the choices when it is none."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown HTTP/2 engine {name!r}: expected one of {', '.join(ENGINES)}")
    return name  # type: ignore[return-value]


def new_engine(name: str, settings: EngineSettings) -> Engine:
    """A fresh connection's engine of kind ``name`` (``initiate`` not yet called)."""
    make = _loaded.get(name)
    if make is None:
        module, cls = _IMPLEMENTATIONS[check_engine(name)]
        make = _loaded[name] = getattr(importlib.import_module(module), cls)
    return make(settings)


__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineName", "check_engine", "new_engine"]
