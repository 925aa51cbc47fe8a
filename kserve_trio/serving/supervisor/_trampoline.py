"""The first code a supervised child runs: tie it to the supervisor's life, pin it, exec.

``launch`` starts every child as ``python -I -S _trampoline.py --parent PID [--cpus LIST] --
COMMAND...`` (why a child's set-up runs here and not between fork and exec: ``_launch``). This
script (run by path, standard library only, so it starts in a few milliseconds) then:

1. asks the kernel for ``SIGTERM`` when the supervisor dies (``prctl(PR_SET_PDEATHSIG)``; it
   survives ``exec``), so no child outlives a supervisor that was killed outright;
2. exits if the supervisor already died before step 1 (the parent pid changed);
3. applies the CPU affinity, which ``exec`` keeps too;
4. replaces itself with ``COMMAND`` (same pid, same environment); a command that cannot be
   executed exits 127 with the reason on stderr.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _parse(argv: list[str]) -> tuple[int, list[int], list[str]]:
    parent, cpus = 0, []
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--parent":
            parent = int(argv[i + 1])
        elif argv[i] == "--cpus":
            for part in argv[i + 1].split(","):
                lo, _, hi = part.partition("-")
                cpus.extend(range(int(lo), int(hi or lo) + 1))
        else:
            raise SystemExit(f"trampoline: unknown option {argv[i]!r}")
        i += 2
    return parent, cpus, argv[i + 1 :]


def main(argv: list[str]) -> None:
    parent, cpus, command = _parse(argv)
    if not command:
        raise SystemExit("trampoline: no command after --")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        print(f"trampoline: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    if parent and os.getppid() != parent:
        raise SystemExit(0)
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            print(f"trampoline: cannot pin to cpus {cpus}: {exc}", file=sys.stderr)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"trampoline: cannot execute {command[0]!r}: {exc}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
