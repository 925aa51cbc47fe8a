"""``build_worker`` constructs and wires a worker's parts and starts nothing: no port is bound,
no front end is launched, the repository is not loaded yet, and the parts are the ones the RPC
adapters share (``WorkerState``) and the scrape reads. It runs on the event loop the worker will
serve on (``serve_async`` calls it there)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from kserve_trio.worker.heartbeat import register_serve_guard, unregister_serve_guard
from kserve_trio.worker.parts import WorkerParts, build_worker
from kserve_trio.worker.server import resolve_config

pytestmark = pytest.mark.anyio  # the servers' parts take the event loop they will run on


@contextlib.contextmanager
def _taken_port() -> Iterator[int]:
    """A loopback port held bound (not listening) by this test for the block's duration: a
    part that bound it would fail."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()


@contextlib.contextmanager
def _built(tmp_path, **endpoints) -> Iterator[WorkerParts]:
    config = resolve_config(
        None,
        model_dirs=[str(tmp_path)],
        model_control_mode="static",
        endpoints={"host": "127.0.0.1", **endpoints},
    )
    parts = build_worker(config)
    try:
        yield parts
    finally:
        parts.tracing.close()
        parts.cache.close()
        parts.repository.close()


async def test_one_process_worker_gets_a_grpc_server_and_rest_and_binds_nothing(tmp_path):
    with _taken_port() as grpc_port, _taken_port() as http_port, _taken_port() as metrics_port:
        with _built(
            tmp_path, port=grpc_port, http_port=http_port, metrics_port=metrics_port
        ) as parts:
            assert parts.grpc is not None and parts.frontends is None
            assert parts.rest is not None
            state = parts.state
            assert state.repository is parts.repository
            assert parts.service.state is state and parts.control.state is state
            assert state.metrics is parts.metrics and state.tracing is parts.tracing
            assert state.scheduler is parts.scheduler
            assert state.loading and not state.server_ready()  # loading is serve_async's


async def test_front_end_worker_gets_front_ends_not_started(tmp_path):
    with _taken_port() as grpc_port:
        with _built(tmp_path, port=grpc_port, frontend_processes=2) as parts:
            assert parts.grpc is None and parts.rest is None
            assert parts.frontends is not None
            assert [f.process for f in parts.frontends.frontends] == [None, None]
            assert parts.frontends.rpcs.listing()  # the RPCs a Hello will list


async def test_the_scrape_reads_the_built_state(tmp_path):
    with _taken_port() as grpc_port:
        with _built(tmp_path, port=grpc_port) as parts:
            text = parts.exposition().decode()
    assert "worker_models_loaded 0.0" in text
    assert 'control_mode="static"' in text  # worker_info, from the state's config


async def test_a_serve_guards_refusal_propagates_from_build_worker(tmp_path):
    class Refused(Exception):
        pass

    def guard(config):
        raise Refused(config.endpoints.port)

    register_serve_guard(guard)
    try:
        with _taken_port() as grpc_port:
            with pytest.raises(Refused):
                with _built(tmp_path, port=grpc_port):
                    pass
    finally:
        unregister_serve_guard(guard)
