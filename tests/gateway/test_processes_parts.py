"""The parts of a gateway in several processes, each alone: the port reservation, the shared
shared-memory record, the children's environment and configuration, who removes the runtime
directory, the restart back-off, the parent's /routing and the ``processes`` setting."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.gateway.config import (
    GatewayConfig,
    ListenConfig,
    ProberConfig,
    load_gateway_config,
)
from kserve_trio.gateway.processes._admin import routing_intersection
from kserve_trio.gateway.processes._children import RESTART_POLICY
from kserve_trio.gateway.processes._layout import (
    ProcessRole,
    create_runtime_dir,
    read_announcement,
    remove_runtime_dir,
    remove_stale_runtime_dirs,
)
from kserve_trio.gateway.processes._parent import child_env, child_raw_config
from kserve_trio.gateway.shm_record import SharedShmRegistrations
from kserve_trio.serving.metrics_merge import add_label
from kserve_trio.serving.ports import reserve_port
from tests.waiting import until

G = "KSERVE_TRIO_GATEWAY_"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


def test_the_reserved_port_takes_no_connection_until_a_child_listens_on_it():
    reserved = reserve_port("127.0.0.1", 0, "listen.grpc")
    try:
        assert reserved.port > 0 and len(reserved.sockets) == 1
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: refused
            socket.create_connection(("127.0.0.1", reserved.port), timeout=5).close()
        plain = socket.socket()
        with pytest.raises(OSError) as info:  # reserved: nobody without SO_REUSEPORT gets it
            plain.bind(("127.0.0.1", reserved.port))
        plain.close()
        assert info.value.errno == errno.EADDRINUSE
        child = socket.socket()
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        child.bind(("127.0.0.1", reserved.port))
        child.listen()
        with socket.create_connection(("127.0.0.1", reserved.port), timeout=5):
            accepted, _ = child.accept()  # the listening child gets the connection
            accepted.close()
        child.close()
    finally:
        reserved.close()
    assert reserved.sockets == []


def test_a_port_that_cannot_be_reserved_names_the_key():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError, match=r"^\[Errno \d+\] listen.http 127.0.0.1:\d+: "):
            reserve_port("127.0.0.1", taken.getsockname()[1], "listen.http")
    finally:
        taken.close()


def test_a_port_another_program_shares_with_so_reuseport_is_refused_not_shared():
    """Another listener of the same user with SO_REUSEPORT on the port (an older gateway, or
    another test's): the reservation must fail as for any taken port. Before, the gateway bound
    it too and the kernel split the connections between them (seen as a test's admin request
    answered by another gateway's gRPC port under a parallel run)."""
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    try:
        with pytest.raises(OSError) as info:
            reserve_port("127.0.0.1", other.getsockname()[1], "listen.grpc")
        assert info.value.errno == errno.EADDRINUSE
        assert "listen.grpc 127.0.0.1:" in str(info.value)
    finally:
        other.close()


@pytest.mark.anyio
async def test_one_record_for_every_process_and_one_holder_at_a_time(tmp_path):
    record = tmp_path / "shm-registrations.json"
    a, b = SharedShmRegistrations(record), SharedShmRegistrations(record)  # two processes' views
    async with a.exclusive():
        a.registered("r0", b"zero")
        a.registered("r1", b"one")
    assert b.items() == [("r0", b"zero"), ("r1", b"one")]  # read through the file
    async with b.exclusive():
        b.unregistered("r0")
    assert a.items() == [("r1", b"one")] and "r0" not in a and len(a) == 1
    order: list[str] = []

    def on_the_lock_file() -> int:
        """This process's descriptors open on the lock file: one per view that holds the
        record or polls for it."""
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                count += os.readlink(f"/proc/self/fd/{fd}") == str(a.lock_path)
        return count

    async def hold(regs: SharedShmRegistrations, name: str, entered: anyio.Event) -> None:
        async with regs.exclusive():
            entered.set()
            order.append(f"{name} in")
            if name == "a":  # held until b is polling for the file lock
                await until(lambda: on_the_lock_file() == 2, what="b waiting for the lock")
            order.append(f"{name} out")

    first, second = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(hold, a, "a", first)
        await first.wait()
        tg.start_soon(hold, b, "b", second)  # another "process": waits for the file lock
    assert order == ["a in", "a out", "b in", "b out"]
    async with b.exclusive():
        b.unregistered("")
    assert a.items() == [] and json.loads(record.read_text()) == []


def test_the_children_get_the_resolved_ports_and_no_gateway_variables():
    config = GatewayConfig(
        endpoints=("127.0.0.1:9001",),
        listen=ListenConfig("127.0.0.1:0", "0.0.0.0:9102", "127.0.0.1:0"),
        prober=ProberConfig(startup_wait_seconds=math.inf, health_interval_seconds=0.5),
        processes=3,
    )
    grpc = reserve_port("127.0.0.1", 0, "listen.grpc")
    http = reserve_port("127.0.0.1", 0, "listen.http")
    try:
        raw = child_raw_config(config, grpc, http)
        assert raw["listen"] == {
            "grpc": f"127.0.0.1:{grpc.port}",
            "metrics": "127.0.0.1:0",
            "http": f"127.0.0.1:{http.port}",
        }
        assert raw["processes"] == 3 and raw["endpoints"] == ["127.0.0.1:9001"]
    finally:
        grpc.close()
        http.close()
    env = child_env(
        {G + "WORKERS": "x:1", G + "LISTEN_GRPC": "0.0.0.0:0", "REACTANT_GATEWAY_WORKERS": "y:1",
         "PYTHONPATH": "/src", G + "HOSTS_FILE": "/etc/h"},
        config,
    )  # fmt: skip
    assert env == {
        "PYTHONPATH": "/src",
        G + "STARTUP_WAIT_SECONDS": "inf",
        G + "HEALTH_INTERVAL_SECONDS": "0.5",
        G + "WEDGE_EXIT_ROUNDS": "3",
    }


def test_a_child_reads_back_the_configuration_the_parent_wrote(tmp_path):
    config = load_gateway_config(
        env={
            G + "WORKERS": "127.0.0.1:9001",
            G + "PROCESSES": "2",
            G + "LISTEN_GRPC": "127.0.0.1:0",
        }
    ).config
    grpc = reserve_port("127.0.0.1", 0, "listen.grpc")
    try:
        path = tmp_path / "gateway.json"
        path.write_text(json.dumps(child_raw_config(config, grpc, None)))
        again = load_gateway_config(path, env={}).config
    finally:
        grpc.close()
    assert again.listen.grpc_address == ("127.0.0.1", grpc.port)
    assert again.processes == 2
    assert (again.endpoints, again.scheduling, again.limits) == (
        config.endpoints,
        config.scheduling,
        config.limits,
    )


def test_an_announcement_counts_only_for_the_pid_that_wrote_it(tmp_path):
    import os

    assert read_announcement(tmp_path, 0, os.getpid()) is None
    ProcessRole(0, 2, tmp_path).announce(4242)
    assert read_announcement(tmp_path, 0, os.getpid()) == 4242
    assert read_announcement(tmp_path, 0, os.getpid() + 1) is None  # an earlier incarnation's
    assert read_announcement(tmp_path, 1, os.getpid()) is None


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def held(path: Path) -> int:
    """A descriptor holding ``path`` as a process of a gateway does (shared flock)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def make_dir(path: Path) -> Path:
    path.mkdir()
    (path / "gateway.json").write_text("{}")
    return path


def test_a_starting_parent_removes_only_runtime_directories_nobody_holds(tmp_path):
    """A directory named for a dead pid that no process holds goes (its gateway was killed
    whole); one whose pid lives, one a process still holds, and every other name stay."""
    dead = dead_pid()
    stale = make_dir(tmp_path / f"kserve_trio-gateway-{dead}-ab12_x")
    live = make_dir(tmp_path / f"kserve_trio-gateway-{os.getpid()}-cd34")
    draining = make_dir(tmp_path / f"kserve_trio-gateway-{dead}-ef56")
    others = [
        make_dir(tmp_path / "kserve_trio-gateway-gh78"),  # an older name: no pid in it
        make_dir(tmp_path / f"other-{dead}-ij90"),
    ]
    (tmp_path / f"kserve_trio-gateway-{dead}-file").write_text("not a directory")
    outside = make_dir(tmp_path / "outside")
    (tmp_path / f"kserve_trio-gateway-{dead}-link").symlink_to(outside)
    fd = held(draining)
    try:
        assert remove_stale_runtime_dirs(tmp_path) == [stale]
    finally:
        os.close(fd)
    assert not stale.exists()
    for kept in (live, draining, *others, outside):
        assert (kept / "gateway.json").read_text() == "{}", kept
    assert (tmp_path / f"kserve_trio-gateway-{dead}-file").read_text() == "not a directory"
    assert (tmp_path / f"kserve_trio-gateway-{dead}-link").is_symlink()
    assert remove_stale_runtime_dirs(tmp_path) == [draining]  # no longer held


def test_the_last_process_of_a_gateway_out_removes_its_runtime_directory(tmp_path, monkeypatch):
    """Children leaving while the parent holds the directory leave it; with the parent killed,
    the last child out removes it, whichever leaves first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runtime_dir, parent = create_runtime_dir()
    assert runtime_dir.parent == tmp_path
    assert runtime_dir.name.startswith(f"kserve_trio-gateway-{os.getpid()}-")
    one, two = ProcessRole(0, 2, runtime_dir), ProcessRole(1, 2, runtime_dir)
    with one.holding():
        pass  # restarted while the parent lives
    assert runtime_dir.is_dir()
    first, second = one.holding(), two.holding()
    first.__enter__()
    second.__enter__()
    os.close(parent)  # the parent is killed outright: the kernel drops its lock
    first.__exit__(None, None, None)
    assert runtime_dir.is_dir()  # a sibling still drains
    second.__exit__(None, None, None)
    assert not runtime_dir.exists()
    again, fd = create_runtime_dir()
    remove_runtime_dir(again, fd)
    assert list(tmp_path.iterdir()) == []


def test_restart_backoff_doubles_from_a_quarter_second_to_ten_for_ever():
    policy = RESTART_POLICY
    assert [policy.pause(k) for k in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert policy.failures_after(3, 30.0) == 1, "a child that stayed up starts counting again"
    assert not any(policy.gives_up(k) for k in range(1, 100))
    assert policy.must_come_up_first, "a child that never came up fails the gateway"


def test_routing_lists_what_every_process_routes():
    one = {
        "models": {"mlp": ["w0", "w1"], "cnn": ["w0"]},
        "workers": [{"worker": "w0", "ready": True}, {"worker": "w1", "ready": True}],
    }
    two = {
        "models": {"mlp": ["w1", "w0"]},
        "workers": [{"worker": "w0", "ready": True}, {"worker": "w1", "ready": False}],
    }
    assert routing_intersection([one, two]) == {
        "models": {"mlp": ["w0", "w1"]},
        "workers": [{"worker": "w0", "ready": True}, {"worker": "w1", "ready": False}],
    }
    assert routing_intersection([one]) == one
    assert routing_intersection([]) == {"models": {}, "workers": []}


def test_a_label_is_added_where_it_is_missing_only():
    text = '# TYPE a counter\na_total 1\nb{x="1"} 2\nc{gateway_process="parent"} 3\n'
    assert add_label(text, "gateway_process", "0") == (
        '# TYPE a counter\na_total{gateway_process="0"} 1\n'
        'b{x="1",gateway_process="0"} 2\nc{gateway_process="parent"} 3\n'
    )


@pytest.mark.parametrize("value", ["0", "257", "-1"])
def test_processes_must_be_between_1_and_256(value):
    with pytest.raises(ConfigError) as info:
        load_gateway_config(env={G + "WORKERS": "127.0.0.1:9001", G + "PROCESSES": value})
    assert info.value.path == "processes"


def test_processes_defaults_to_one_and_the_flag_overrides_the_environment():
    env = {G + "WORKERS": "127.0.0.1:9001", G + "PROCESSES": "4"}
    assert load_gateway_config(env={G + "WORKERS": "127.0.0.1:9001"}).config.processes == 1
    assert load_gateway_config(env=env).config.processes == 4
    assert load_gateway_config(env=env, overrides={"processes": 2}).config.processes == 2
