"""The conformance cases (``cases.CASES``) against each target (``targets``): every case gets
the answer RFC 9113, RFC 7541 or gRPC over HTTP/2 asks (a connection error, a stream error, a
gRPC status, a PING ACK, or a connection that serves on), and afterwards a new connection to
the same server is served an echo call: no case takes the server down.

The table itself and the raw client's deadline are checked without a server."""

from __future__ import annotations

import socket
import time

import pytest

from tests.serving.grpc.conformance.cases import CASES, Case, expected_on
from tests.serving.grpc.conformance.expect import SENTINEL, serves
from tests.serving.grpc.conformance.frames import AwaitEnd, Wire
from tests.serving.grpc.conformance.raw_client import RawClient
from tests.serving.grpc.conformance.targets import Target


def play(client: RawClient, case: Case) -> Wire:
    """The handshake (unless the case writes its own preface), the case's bytes (each run of
    them in one write, reading until a stream has ended where the case says so), then the
    sentinel PING; the connection's ``Wire`` for judging."""
    if case.handshake:
        client.handshake()
    wire = Wire(client.server_settings)
    pending = bytearray()
    for step in case.send(wire):
        if isinstance(step, AwaitEnd):
            client.send(bytes(pending))
            pending.clear()
            ended = step.stream
            client.wait_for(
                lambda sid=ended: client.done(sid) or client.goaway is not None, f"stream {ended}"
            )
        else:
            pending += step
    client.send(bytes(pending) + wire.ping(SENTINEL))
    return wire


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_server_answers_the_case_as_specified_and_serves_on(target: Target, case: Case):
    with RawClient.connect(target.port) as client:
        wire = play(client, case)
        expected_on(case, target.engine).judge(client, wire)
    serves(target.port)
    assert target.proc.alive()


def test_the_table_has_seventy_cases_or_more_with_distinct_names():
    names = [case.name for case in CASES]
    assert len(names) >= 70
    assert len(set(names)) == len(names)


def test_every_case_builds_frames_on_the_default_settings():
    for case in CASES:
        steps = case.send(Wire({}))
        assert steps, case.name
        assert all(isinstance(s, bytes | AwaitEnd) for s in steps), case.name


def test_a_server_that_answers_nothing_fails_the_wait_within_its_deadline():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts, nobody reads
        port = silent.getsockname()[1]
        with RawClient.connect(port, deadline=0.2) as client:
            started = time.monotonic()
            with pytest.raises(AssertionError, match="the server's SETTINGS"):
                client.handshake()
            assert time.monotonic() - started < 5
