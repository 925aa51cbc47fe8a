"""The supervisor's process handling, on small Python children: output, restarts, budgets,
signals, graces, the parent-death signal and the trampoline's pinning."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from trio.testing import MockClock

from kserve_trio.node import ChildSpec, NodePlan, run_plan
from kserve_trio.node._logmux import LogSink
from kserve_trio.node._supervisor import describe_exit
from tests.node.conftest import alive
from tests.waiting import until, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

SLEEP = "import time\nwhile True: time.sleep(1)"
IGNORE_TERM = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('handler installed', flush=True)\n" + SLEEP
)
"""A child that ignores SIGTERM; it says so once the handler is in place."""


def child(name: str, code: str, grace: float = 5.0, **kw) -> ChildSpec:
    return ChildSpec(name, "worker", (sys.executable, "-c", code), dict(os.environ), grace, **kw)


def run_in_process(plan: NodePlan, clock: MockClock | None = None) -> tuple[int, list[str]]:
    """``run_plan`` on asyncio, or on trio with ``clock`` as its clock (the supervisor's
    pauses and graces then take no real time)."""
    out = io.StringIO()
    run = functools.partial(run_plan, plan, LogSink(out), install_signal_handlers=False)
    if clock is None:
        code = anyio.run(run, backend="asyncio")
    else:
        code = anyio.run(run, backend="trio", backend_options={"clock": clock})
    return code, out.getvalue().splitlines()


class FakeNode:
    """``fake_node.py`` as a subprocess, its output in a file."""

    def __init__(self, tmp_path: Path, children: list[dict], max_restarts: int = 0) -> None:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"max_restarts": max_restarts, "children": children}))
        self.log = tmp_path / "node.log"
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_node.py"), str(spec)],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """The first match of ``pattern`` in the output once it is there; AssertionError with
        the output past ``timeout`` or when the process exited without it."""

        def found() -> re.Match | None:
            exited = self.proc.poll() is not None  # before the read: its output is all there
            m = re.search(pattern, self.text())
            if m is None and exited:
                raise AssertionError(f"the process exited ({self.proc.returncode})")
            return m

        try:
            return wait_until(found, timeout, f"{pattern!r} in the output")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.text()}") from None

    def pid_of(self, name: str) -> int:
        return int(self.wait_for(rf"\[supervisor\] started {name} \(pid (\d+)\)").group(1))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


@pytest.fixture
def fake_node(tmp_path):
    nodes: list[FakeNode] = []

    def start(children: list[dict], max_restarts: int = 0) -> FakeNode:
        node = FakeNode(tmp_path, children, max_restarts)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.close()


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# --- output ------------------------------------------------------------------------------------


def test_child_output_is_prefixed_line_by_line_including_stderr_and_a_partial_last_line():
    record = {"event": "server_up", "address": "127.0.0.1:1"}
    code = (
        "import json, sys\n"
        f"print(json.dumps({record!r}), flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "sys.stdout.write('partial tail'); sys.stdout.flush()\n"
        "sys.exit(4)\n"
    )
    exit_code, lines = run_in_process(NodePlan("workers", (child("w", code),), max_restarts=1))
    assert exit_code == 1
    mine = [line for line in lines if line.startswith("[w] ")]
    assert len(mine) == 6  # two runs of three lines
    jsons = [json.loads(line.removeprefix("[w] ")) for line in mine if line.startswith("[w] {")]
    assert jsons == [record, record]
    assert mine.count("[w] to stderr") == 2
    assert mine.count("[w] partial tail") == 2
    assert all(line.startswith(("[w] ", "[supervisor] ")) for line in lines)


def test_exit_descriptions():
    assert describe_exit("w", 3, 1.25) == "w exited (code=3, signal=none, uptime=1.2s)"
    assert describe_exit("w", -9, 0.0) == "w exited (code=none, signal=SIGKILL, uptime=0.0s)"
    assert describe_exit("w", None, 2) == "w exited (code=none, signal=none, uptime=2.0s)"


# --- restarts and the crash-loop budget ----------------------------------------------------------


def test_a_crashing_child_backs_off_then_exhausts_the_budget():
    # on trio's MockClock (it jumps to the next timer whenever every task waits): the children
    # are real, the pauses between them take no real time and are exactly what they say
    clock = MockClock(autojump_threshold=0)
    started = clock.current_time()
    exit_code, lines = run_in_process(
        NodePlan("workers", (child("w", "raise SystemExit(3)"),), max_restarts=2), clock
    )
    elapsed = clock.current_time() - started
    assert exit_code == 1
    events = [line for line in lines if line.startswith("[supervisor] ")]
    restarts = [e for e in events if "restarting" in e]
    assert restarts == ["[supervisor] restarting w in 1s", "[supervisor] restarting w in 2s"]
    assert sum("w exited (code=3, signal=none" in e for e in events) == 3
    assert "[supervisor] w failed 3 consecutive times (max 2); shutting the node down" in events
    assert events[-1] == "[supervisor] node stopped (exit 1)"
    assert elapsed == 3.0  # the two pauses, 1 s and 2 s; nothing else waited on a timer


def test_a_child_that_cannot_be_executed_counts_as_a_failure():
    spec = ChildSpec("ghost", "worker", ("/nonexistent/program",), dict(os.environ), 1.0)
    exit_code, lines = run_in_process(NodePlan("workers", (spec,), max_restarts=1))
    assert exit_code == 1
    assert any(
        line.startswith("[ghost] trampoline: cannot execute '/nonexistent/program'")
        for line in lines
    )
    assert "[supervisor] ghost exited (code=127, signal=none" in "\n".join(lines)


def test_a_giving_up_child_stops_its_healthy_siblings():
    healthy = child("ok", SLEEP)
    exit_code, lines = run_in_process(
        NodePlan("workers", (healthy, child("bad", "raise SystemExit(1)")), max_restarts=1)
    )
    assert exit_code == 1
    assert any(
        line.startswith("[supervisor] ok exited (code=none, signal=SIGTERM") for line in lines
    )


def test_cancelling_the_supervisor_stops_its_children():
    out = io.StringIO()
    pids: list[int] = []

    async def main() -> None:
        plan = NodePlan("workers", (child("w", SLEEP),))
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(run_plan, plan, LogSink(out), install_signal_handlers=False)
            )
            m = await until(
                lambda: re.search(r"started w \(pid (\d+)\)", out.getvalue()), 30, "w started"
            )
            pids.append(int(m.group(1)))
            assert alive(pids[0])
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert not alive(pids[0])
    assert "w exited (code=none, signal=SIGTERM" in out.getvalue()


# --- signals and graces ------------------------------------------------------------------------


def test_sigterm_stops_every_child_and_exits_zero(fake_node):
    node = fake_node([{"name": "a", "argv": py(SLEEP)}, {"name": "b", "argv": py(SLEEP)}])
    pids = [node.pid_of("a"), node.pid_of("b")]
    assert all(alive(p) for p in pids)
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=20) == 0
    out = node.text()
    assert "[supervisor] received shutdown signal (SIGTERM)" in out
    assert "[supervisor] a exited (code=none, signal=SIGTERM" in out
    assert "[supervisor] b exited (code=none, signal=SIGTERM" in out
    assert out.rstrip().endswith("[supervisor] node stopped (exit 0)")
    assert not any(alive(p) for p in pids)


def test_a_child_that_ignores_sigterm_is_killed_after_its_grace(fake_node):
    node = fake_node([{"name": "stubborn", "argv": py(IGNORE_TERM), "grace": 1}])
    pid = node.pid_of("stubborn")
    node.wait_for(r"handler installed")
    started = time.monotonic()
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(timeout=20) == 0
    assert 1.0 <= time.monotonic() - started < 10
    out = node.text()
    assert "[supervisor] stubborn did not exit within 1s; sending SIGKILL" in out
    assert "[supervisor] stubborn exited (code=none, signal=SIGKILL" in out
    assert not alive(pid)


def test_a_second_signal_kills_without_waiting_out_the_grace(fake_node):
    node = fake_node([{"name": "stubborn", "argv": py(IGNORE_TERM), "grace": 60}])
    pid = node.pid_of("stubborn")
    node.wait_for(r"handler installed")
    node.proc.send_signal(signal.SIGTERM)
    node.wait_for(r"received shutdown signal")
    started = time.monotonic()
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(timeout=20) == 0
    assert time.monotonic() - started < 10
    assert "[supervisor] received SIGINT again; killing the children now" in node.text()
    assert not alive(pid)


def test_children_die_with_a_killed_supervisor(fake_node):
    node = fake_node([{"name": "orphan", "argv": py(SLEEP)}])
    pid = node.pid_of("orphan")
    node.proc.kill()  # SIGKILL: no handler runs, only the kernel's parent-death signal
    node.proc.wait()
    wait_until(lambda: not alive(pid), 10, "the orphan gone with its supervisor")


# --- the trampoline ----------------------------------------------------------------------------


def test_the_child_is_pinned_and_runs_its_own_command_with_its_environment(fake_node):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    node = fake_node(
        [{"name": "pinned", "argv": py(SLEEP), "cpus": [cpu], "env": {"PROBE_VAR": "42"}}]
    )
    pid = node.pid_of("pinned")

    def execed() -> list[bytes] | None:  # the pid is the trampoline's until it execs
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return cmdline if cmdline[1:2] == [b"-c"] else None

    cmdline = wait_until(execed, 10, "the child's own command")
    assert b"_trampoline.py" not in b" ".join(cmdline)
    status = Path(f"/proc/{pid}/status").read_text()
    assert re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1) == str(cpu)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"PROBE_VAR=42" in environ
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=20) == 0
