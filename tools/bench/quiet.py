"""Run one benchmark command and say how much CPU every *other* process used meanwhile.

For the benchmarks that do not record it per point themselves (``infer_wire.py``, ``run.py``,
``client_transport.py``, ``rest_forward.py --clients``, ``python -m kserve_trio bench``): the
machine's busy time over the command (``/proc/stat``) minus the command's own processes
(itself and its children, from ``getrusage``) and minus the processes named by ``--exclude``
(a server started beside it, with its descendants). The line goes to stderr; the exit code is
the command's. Above ``noise.NOISY_CORES`` the run is to be measured again.

Usage: python tools/bench/quiet.py [--exclude PID[,PID]] -- COMMAND [ARGS...]
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from noise import NOISY_CORES, cpu_seconds, machine_busy_seconds


def main() -> int:
    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("--exclude", default="", help="PIDs of servers measured beside the command")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    excluded = [int(x) for x in args.exclude.split(",") if x]

    def own() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime + sum(cpu_seconds(pid) for pid in excluded)

    busy0, own0, t0 = machine_busy_seconds(), own(), time.monotonic()
    code = subprocess.call(command)
    busy1, own1, t1 = machine_busy_seconds(), own(), time.monotonic()
    wall = max(t1 - t0, 1e-9)
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    verdict = "quiet" if others <= NOISY_CORES else "NOISY: measure again"
    print(
        f"others: {others:.3f} cores over {wall:.0f} s (the command: {(own1 - own0) / wall:.2f}"
        f" cores); {verdict}",
        file=sys.stderr,
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
