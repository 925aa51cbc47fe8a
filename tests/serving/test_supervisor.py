"""The one supervisor (``serving.supervisor``): the restart policy's numbers, the keep-running
loop on trio's ``MockClock`` with scripted runs, and the launcher on real child processes
(exit status, inherited descriptors, pipes, several waiters, cancelling a wait, SIGTERM then
SIGKILL after the grace, the parent-death signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
import trio.testing

from kserve_trio.serving.supervisor import (
    PIPE,
    TRAMPOLINE,
    ChildProcess,
    Exit,
    GaveUp,
    Restart,
    RestartPolicy,
    keep_running,
    launch,
    trampoline_argv,
)
from tests.waiting import wait_until

QUICK = RestartPolicy(first_pause=0.25, max_pause=10.0, stable_after=30.0)

# --- the policy --------------------------------------------------------------------------------


def test_the_pause_doubles_from_the_first_to_the_cap():
    assert [QUICK.pause(k) for k in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    slow = RestartPolicy(first_pause=1.0, max_pause=30.0, stable_after=60.0)
    assert [slow.pause(k) for k in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_stable_uptime_counts_as_a_first_failure_again():
    failures = 0
    for _ in range(3):
        failures = QUICK.failures_after(failures, 1.0)
    assert failures == 3
    assert QUICK.failures_after(failures, 30.0) == 1
    assert QUICK.failures_after(1, 29.9) == 2


def test_it_gives_up_past_max_failures_and_never_when_zero():
    bounded = RestartPolicy(1.0, 30.0, 60.0, max_failures=2)
    assert [bounded.gives_up(k) for k in (1, 2, 3)] == [False, False, True]
    assert not any(QUICK.gives_up(k) for k in range(1, 1000))


# --- the loop ----------------------------------------------------------------------------------


def on_mock_clock(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """The async ``test`` run on trio with a clock that jumps to the next timer whenever every
    task waits."""

    def run() -> None:
        clock = trio.testing.MockClock(autojump_threshold=0)
        anyio.run(test, backend="trio", backend_options={"clock": clock})

    return run


def scripted(runs: list[tuple[float, Exit]]):
    """A ``run_once`` whose k-th process lives ``runs[k][0]`` seconds and ends as
    ``runs[k][1]``; the start times are recorded."""
    starts: list[float] = []

    async def run_once() -> Exit:
        starts.append(anyio.current_time())
        uptime, ended = runs[len(starts) - 1]
        await anyio.sleep(uptime)
        return ended

    return run_once, starts


@on_mock_clock
async def test_each_restart_waits_its_pause_and_is_told_first():
    policy = RestartPolicy(1.0, 30.0, 60.0, max_failures=3)
    run_once, starts = scripted([(0.5, Exit(3))] * 3 + [(0.5, Exit(4))])
    told: list[Restart] = []
    gave_up = await keep_running(run_once, policy, anyio.Event(), told.append)
    assert starts == [0.0, 1.5, 4.0, 8.5]  # each run's 0.5 s, then 1, 2, 4 s
    assert [(r.failures, r.pause, r.uptime) for r in told] == [
        (1, 1.0, 0.5),
        (2, 2.0, 0.5),
        (3, 4.0, 0.5),
    ]
    assert gave_up == GaveUp(Exit(4), failures=4, never_up=False)


@on_mock_clock
async def test_a_long_run_restarts_the_count():
    policy = RestartPolicy(1.0, 30.0, 60.0, max_failures=2)
    run_once, starts = scripted([(0, Exit(1)), (0, Exit(1)), (60, Exit(1)), (0, Exit(1))] * 2)
    told: list[Restart] = []
    gave_up = await keep_running(run_once, policy, anyio.Event(), told.append)
    assert [r.failures for r in told] == [1, 2, 1, 2]
    assert gave_up is not None and gave_up.failures == 3 and len(starts) == 5


@on_mock_clock
async def test_a_process_that_never_came_up_gives_up_at_once_one_that_did_is_restarted():
    policy = RestartPolicy(0.25, 10.0, 30.0, must_come_up_first=True)
    run_once, starts = scripted([(1, Exit(2, came_up=False))])
    gave_up = await keep_running(run_once, policy, anyio.Event())
    assert gave_up == GaveUp(Exit(2, came_up=False), failures=1, never_up=True)
    assert len(starts) == 1

    stop = anyio.Event()
    runs = [(1, Exit(0)), (1, Exit(2, came_up=False)), (1, Exit(2, came_up=False))]
    run_once, starts = scripted([*runs, (100, Exit(0))])

    def stop_before_the_fourth(restart: Restart) -> None:
        if restart.failures == 3:
            stop.set()

    assert await keep_running(run_once, policy, stop, stop_before_the_fourth) is None
    assert len(starts) == 3, "a stop set during a pause starts nothing more"


@on_mock_clock
async def test_a_stop_during_a_run_ends_the_loop_without_a_restart():
    stop = anyio.Event()
    told: list[Restart] = []

    async def run_once() -> Exit:
        stop.set()  # the caller stops its process its own way; this one exits
        return Exit(-15)

    assert await keep_running(run_once, QUICK, stop, told.append) is None
    assert told == []


@on_mock_clock
async def test_a_stop_cuts_a_pause_short():
    stop = anyio.Event()
    run_once, starts = scripted([(0, Exit(1))] * 20)

    async def stop_later() -> None:
        await anyio.sleep(5.0)
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_later)
        assert await keep_running(run_once, RestartPolicy(100.0, 100.0, 60.0), stop) is None
    assert len(starts) == 1 and anyio.current_time() == 5.0


# --- the launcher ------------------------------------------------------------------------------


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_command_goes_through_the_trampoline():
    argv = trampoline_argv(["prog", "--flag"], 123, "0-2,5", python="/py")
    assert argv[:4] == ["/py", "-I", "-S", TRAMPOLINE]
    assert argv[4:] == ["--parent", "123", "--cpus", "0-2,5", "--", "prog", "--flag"]
    assert TRAMPOLINE.endswith("kserve_trio/serving/supervisor/_trampoline.py")
    assert "--cpus" not in trampoline_argv(["prog"], 1)


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_a_child_gets_its_descriptors_environment_and_pipes_and_its_status_is_read(backend):
    async def main() -> None:
        read_end, write_end = os.pipe()
        try:
            child = launch(
                python(
                    "import os, sys\n"
                    f"os.write({write_end}, os.environ['PROBE'].encode())\n"
                    "print('out', flush=True); print('err', file=sys.stderr, flush=True)\n"
                    "sys.exit(7)\n"
                ),
                env={**os.environ, "PROBE": "inherited"},
                stdout=PIPE,
                stderr=PIPE,
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        assert child.stdout is not None and child.stderr is not None
        out = b"".join([chunk async for chunk in child.stdout])
        err = b"".join([chunk async for chunk in child.stderr])
        assert await child.wait() == 7 and child.returncode == 7
        child.close()
        assert (out, err) == (b"out\n", b"err\n")
        assert os.read(read_end, 100) == b"inherited"
        os.close(read_end)

    if backend == "trio":
        anyio.run(main, backend="trio")
    else:
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": backend == "uvloop"})


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_several_tasks_wait_and_a_cancelled_waiter_hands_over(backend):
    async def main() -> None:
        child = launch(python("import time; time.sleep(600)"))
        seen: list[object] = []
        first = anyio.CancelScope()

        async def waiter(scope: anyio.CancelScope) -> None:
            with scope:
                seen.append(await child.wait())
                return
            seen.append("cancelled")

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, first)  # the one on the pidfd
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(waiter, anyio.CancelScope())
            tg.start_soon(waiter, anyio.CancelScope())
            await anyio.wait_all_tasks_blocked()
            first.cancel()
            await anyio.wait_all_tasks_blocked()
            assert seen == ["cancelled"] and child.returncode is None
            child.send_signal(signal.SIGTERM)
        assert seen == ["cancelled", -signal.SIGTERM, -signal.SIGTERM]

    anyio.run(main, backend=backend)


IGNORE_TERM = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\ntime.sleep(600)\n"
)
"""A child that ignores SIGTERM; it says ``ready`` once the handler is in place."""


async def said_ready(child: ChildProcess) -> None:
    assert child.stdout is not None
    said = b""
    async for chunk in child.stdout:
        said += chunk
        if said.endswith(b"\n"):
            break
    assert said == b"ready\n"


def test_stop_sends_sigterm_then_sigkill_after_the_grace():

    async def main() -> None:
        polite = launch(
            python("import time; print('ready', flush=True); time.sleep(600)"), stdout=PIPE
        )
        stubborn = launch(python(IGNORE_TERM), stdout=PIPE, new_session=True)
        for child in (polite, stubborn):
            await said_ready(child)
        killed: list[int] = []
        assert await polite.stop(60.0, on_kill=lambda: killed.append(polite.pid)) == -signal.SIGTERM
        started = anyio.current_time()
        assert (
            await stubborn.stop(0.5, on_kill=lambda: killed.append(stubborn.pid)) == -signal.SIGKILL
        )
        assert anyio.current_time() - started >= 0.5
        assert killed == [stubborn.pid]
        polite.close()
        stubborn.close()

    anyio.run(main, backend="asyncio")


def test_stop_is_cut_short_by_its_event():
    async def main() -> None:
        child = launch(python(IGNORE_TERM), stdout=PIPE)
        await said_ready(child)
        sooner = anyio.Event()
        sooner.set()
        assert await child.stop(600.0, sooner=sooner) == -signal.SIGKILL
        child.close()

    anyio.run(main, backend="trio")


def test_a_command_that_cannot_run_exits_127():
    async def main() -> int:
        child = launch(["/nonexistent/program"], stderr=subprocess.DEVNULL)
        return await child.wait()

    assert anyio.run(main, backend="asyncio") == 127


def test_a_child_dies_with_a_parent_killed_outright(tmp_path):
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(
        python(
            "import anyio, sys, time\n"
            "from kserve_trio.serving.supervisor import launch\n"
            "async def main():\n"
            "    child = launch([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "    await child.wait()\n"
            "anyio.run(main, backend='asyncio')\n"
        )
    )
    try:
        child_pid = wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "the pid")
        assert alive(int(child_pid))
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(int(child_pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(int(child_pid))
