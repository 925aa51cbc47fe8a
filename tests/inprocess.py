"""A worker served in this process on a background loop, on an ephemeral port: the shape most
worker-level tests share (``with in_process_worker(repo) as running: ...``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from kserve_trio.worker.server import RunningServer, serve, stop


@contextlib.contextmanager
def in_process_worker(
    *model_dirs: str | os.PathLike[str], **overrides: Any
) -> Iterator[RunningServer]:
    """Serve ``model_dirs`` (static model control unless ``overrides`` say otherwise) and stop
    the worker on exit; ``overrides`` are raw config values in YAML shape, as ``serve`` takes."""
    overrides.setdefault("model_control_mode", "static")
    overrides.setdefault("endpoints", {})
    overrides["endpoints"].setdefault("port", 0)
    running = serve(None, blocking=False, model_dirs=[str(d) for d in model_dirs], **overrides)
    assert running is not None
    try:
        yield running
    finally:
        stop(running)
