"""jax's 64-bit mode, scoped to the modules and transfers that carry 64-bit tensors.

Outside its 64-bit mode jax narrows ``int64``/``uint64``/``float64`` to 32 bits wherever it
builds a type from a numpy dtype (the argument specs of a compile, the arguments of a call, a
``device_put``), so a bundle with such a tensor would fail to load ("expected int64 and called
with int32") or lose precision. The runtime therefore compiles, calls and places the weights of
exactly those modules inside ``x64_scope()``, jax's thread-local ``enable_x64``.

The process-wide ``jax_enable_x64`` flag is left as the user set it, on purpose: turning it on
for the whole process would change what every other piece of jax code in it computes (default
dtypes become 64-bit, Python scalars promote to ``float64``), which matters wherever the runtime
is used as a library next to user code, and 32-bit modules keep exactly the code path they had.
A 64-bit module pays for one context enter/exit per call, which is small beside the call
(docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

WIDE_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(t) for t in ("int64", "uint64", "float64", "complex128")
)
"""The dtypes jax narrows to 32 bits outside its 64-bit mode."""


def needs_x64(dtypes: Iterable[Any]) -> bool:
    """Whether any of ``dtypes`` is one that jax narrows outside its 64-bit mode."""
    return any(np.dtype(d) in WIDE_DTYPES for d in dtypes)


def x64_scope() -> Any:
    """A fresh context manager that turns jax's 64-bit mode on for the current thread.

    Fresh on every use: jax's context-manager object keeps the previous value on itself, so one
    object shared by two threads (the device thread and a loader) could restore the wrong one.
    """
    import jax

    return jax.enable_x64(True)


def in_x64(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` wrapped so that every call runs inside ``x64_scope()``."""
    import jax

    state = jax.enable_x64

    def call(*args: Any) -> Any:
        with state(True):
            return fn(*args)

    call.__name__ = getattr(fn, "__name__", "x64_call")
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


__all__ = ["WIDE_DTYPES", "in_x64", "needs_x64", "x64_scope"]
