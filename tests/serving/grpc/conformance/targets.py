"""The servers the conformance cases run against, real CLI processes started once per module:

- ``worker``: a CLI worker;
- ``gateway``: a CLI gateway in front of a CLI worker (the cases hit the gateway's port);
- ``frontend``: a worker with ``--frontend-processes 2`` (a case lands on one of its front ends).

Each serves ``echo``, a meta model (no compilation, so a start takes seconds), with a stream
window of 65535 bytes (``STREAM_WINDOW``) so that a DATA frame past it is cheap to send.

Engines: ``ENGINES`` lists the HTTP/2 engines every target runs on; ``None`` is the command as
it is (the server's default engine), a name adds ``--http2-engine NAME`` to the worker's and the
gateway's command (``engine_args``). ``KSERVE_TRIO_TEST_HTTP2_ENGINE`` (comma-separated names)
runs on those instead.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from kserve_trio.http2 import DEFAULT_ENGINE
from tests.gateway.procs import Gateway, Proc, Worker
from tests.ports import free_port
from tests.serving.grpc.conformance.expect import serves
from tests.waiting import wait_until

ENGINES: tuple[str | None, ...] = ("ngh2", "h2")
KINDS = ("worker", "gateway", "frontend")
STREAM_WINDOW = 65535
START_SECONDS = 120.0

ECHO_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: []
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 4}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 4}}
"""

ECHO_MODEL_PY = """\
from kserve_trio.core.tensors.tensor import NamedTensor


def run(inputs, call):
    (x,) = inputs
    return [NamedTensor.from_array("y", x.data.copy())]


register_meta_model("echo", run=run)
"""


def engines() -> tuple[str | None, ...]:
    """``ENGINES``, or the engines ``KSERVE_TRIO_TEST_HTTP2_ENGINE`` names."""
    named = os.environ.get("KSERVE_TRIO_TEST_HTTP2_ENGINE", "")
    return tuple(named.split(",")) if named else ENGINES


def engine_args(engine: str | None) -> list[str]:
    """The command-line arguments that choose ``engine`` (none for the default)."""
    return [] if engine is None else ["--http2-engine", engine]


def echo_repository(root: pathlib.Path) -> pathlib.Path:
    """``root`` made a model repository holding the ``echo`` meta model."""
    (root / "echo").mkdir(parents=True)
    (root / "echo" / "manifest.yaml").write_text(ECHO_MANIFEST)
    (root / "echo" / "model.py").write_text(ECHO_MODEL_PY)
    return root


class ArgsWorker(Worker):
    """A CLI worker serving ``echo`` with more arguments on its command line."""

    def __init__(self, repo: pathlib.Path, args: list[str]) -> None:
        self.args = args
        env = {"INFERENCE_SERVER_LIMITS_STREAM_WINDOW_BYTES": str(STREAM_WINDOW)}
        super().__init__(repo, "127.0.0.1", free_port(), models="echo", env=env)

    def _argv(self) -> list[str]:
        return [*super()._argv(), *self.args]


@dataclass(frozen=True)
class Target:
    """A running server: its name (with the engine's), gRPC port and HTTP/2 engine."""

    name: str
    port: int
    proc: Proc
    engine: str = DEFAULT_ENGINE


@contextmanager
def running(kind: str, engine: str | None, workdir: pathlib.Path) -> Iterator[Target]:
    """Start the ``kind`` target on ``engine``, wait until it serves an echo call, stop it
    (and what it started) afterwards."""
    repo = echo_repository(workdir / "models")
    args = engine_args(engine)
    with ExitStack() as stack:
        extra = ["--frontend-processes", "2"] if kind == "frontend" else []
        worker = ArgsWorker(repo, [*args, *extra])
        stack.callback(worker.stop)
        worker.wait_ready(START_SECONDS)
        served: Proc = worker
        port = worker.port
        if kind == "gateway":
            g = "KSERVE_TRIO_GATEWAY_"
            env = {g + "WORKERS": worker.url, g + "LIMITS_STREAM_WINDOW_BYTES": str(STREAM_WINDOW)}
            gateway = Gateway(workdir, env, *args)
            stack.callback(gateway.stop)
            gateway.wait_ready(START_SECONDS)
            served, port = gateway, gateway.port
        wait_until(lambda: _serves(port), START_SECONDS, f"{kind} serving the echo model")
        name = kind if engine is None else f"{engine}-{kind}"
        yield Target(name, port, served, engine or DEFAULT_ENGINE)


def _serves(port: int) -> bool:
    try:
        serves(port)
    except (AssertionError, OSError):
        return False
    return True


__all__ = ["ENGINES", "KINDS", "STREAM_WINDOW", "Target", "engine_args", "engines", "running"]
