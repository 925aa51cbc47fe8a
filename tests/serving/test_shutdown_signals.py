"""``serve_until_signal`` in a real process with real signals, on every event loop: a signal
during the start-up cancels the start (the server's clean-up runs, exit 0); a signal while
serving drains; signals during the drain are logged and ignored (the default action would
kill the process before its clean-up), and after it the process still ignores them.

The server is a small async context manager that prints each phase; the drain waits until
the log says the second signal was ignored, so the order is fixed by the events, not by time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.waiting import wait_until

_SCRIPT = textwrap.dedent(
    """
    import contextlib, os, signal, sys
    import anyio
    from kserve_trio.serving.background import run_loop, serve_until_signal

    mode, loop = sys.argv[1], sys.argv[2]
    ignored = None

    def say(what):
        print(what, flush=True)

    class Log:
        def info(self, event, **fields):
            say(f"log {event} {sorted(fields.items())}")
            if event == "shutdown_signal_ignored":
                ignored.set()

    @contextlib.asynccontextmanager
    async def server():
        global ignored
        ignored = anyio.Event()
        try:
            say("starting")
            if mode == "startup":
                await anyio.sleep_forever()
            say("serving")
            yield
            say("draining")
            await ignored.wait()
            say("drained")
        finally:
            say("cleaned up")

    run_loop(serve_until_signal, server(), Log(), event_loop=loop)
    os.kill(os.getpid(), signal.SIGTERM)  # ignored from here to the exit
    say("exiting")
    """
)


class Scripted:
    def __init__(self, mode: str, loop: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, mode, loop],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def wait_for(self, line: str) -> None:
        def seen() -> bool:
            while line not in self.lines:
                out = self.proc.stdout.readline() if self.proc.stdout else ""
                if not out:
                    return False
                self.lines.append(out.strip())
            return True

        wait_until(seen, 60, line)

    def finish(self) -> int:
        out, _ = self.proc.communicate(timeout=60)
        self.lines.extend(out.split("\n"))
        return self.proc.returncode


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_a_signal_during_the_start_up_cancels_it_and_the_clean_up_runs(loop):
    p = Scripted("startup", loop)
    p.wait_for("starting")
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0
    assert "log shutdown_signal [('during_startup', True), ('signal', 'SIGTERM')]" in p.lines
    assert "serving" not in p.lines
    assert p.lines.index("cleaned up") < p.lines.index("exiting")


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_signals_during_the_drain_are_ignored_and_the_drain_completes(loop):
    p = Scripted("serve", loop)
    p.wait_for("serving")
    p.proc.send_signal(signal.SIGTERM)
    p.wait_for("draining")
    p.proc.send_signal(signal.SIGINT)  # the default action would end the process here
    assert p.finish() == 0
    assert "log shutdown_signal [('signal', 'SIGTERM')]" in p.lines
    assert (
        "log shutdown_signal_ignored [('reason', 'already stopping'), ('signal', 'SIGINT')]"
        in p.lines
    )
    order = [p.lines.index(line) for line in ("drained", "cleaned up", "exiting")]
    assert order == sorted(order)
