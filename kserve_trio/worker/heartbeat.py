"""Process-wide serving heartbeat callbacks and serve guards.

``register_heartbeat(f)``: ``f(event, detail)`` is called synchronously for ``up`` (detail: the
ServerConfig, after bring-up), ``request`` (detail: the model name, for every ModelInfer that
completed or failed), ``down`` (detail: the ServerConfig, after teardown), ``load`` and ``unload``
(detail: the model name, from the repository watcher). A callback that raises is logged and
otherwise ignored: a heartbeat must never break serving.

``register_serve_guard(f)``: ``f(config)`` runs before every ``serve`` brings a server up, in
registration order, before anything is allocated; an exception propagates out of ``serve``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.worker.heartbeat")

HEARTBEAT_EVENTS = ("up", "request", "down", "load", "unload")

_lock = threading.Lock()
_heartbeats: list[Callable] = []
_guards: list[Callable] = []


def register_heartbeat(f: Callable) -> Callable:
    """Register ``f(event: str, detail)``; returns ``f`` (usable as a decorator)."""
    if not callable(f):
        raise TypeError("register_heartbeat: f must be callable")
    with _lock:
        _heartbeats.append(f)
    return f


def unregister_heartbeat(f: Callable) -> None:
    """Remove a previously registered heartbeat callback (no-op when absent)."""
    with _lock:
        if f in _heartbeats:
            _heartbeats.remove(f)


def register_serve_guard(f: Callable) -> Callable:
    """Register ``f(config)`` to run before every serve; it refuses by raising."""
    if not callable(f):
        raise TypeError("register_serve_guard: f must be callable")
    with _lock:
        _guards.append(f)
    return f


def unregister_serve_guard(f: Callable) -> None:
    """Remove a previously registered serve guard (no-op when absent)."""
    with _lock:
        if f in _guards:
            _guards.remove(f)


def fire(event: str, detail) -> None:
    """Call every heartbeat callback; exceptions are logged, never raised."""
    if not _heartbeats:  # the common case, checked without the lock (a racy read is harmless)
        return
    with _lock:
        callbacks = list(_heartbeats)
    for f in callbacks:
        try:
            f(event, detail)
        except Exception as exc:
            log.warning("heartbeat_callback_failed", heartbeat_event=event, error=repr(exc))


def run_guards(config) -> None:
    """Run every serve guard in registration order; the first exception propagates."""
    with _lock:
        guards = list(_guards)
    for guard in guards:
        guard(config)


__all__ = [
    "HEARTBEAT_EVENTS",
    "fire",
    "register_heartbeat",
    "register_serve_guard",
    "run_guards",
    "unregister_heartbeat",
    "unregister_serve_guard",
]
