"""The test suite's port source: below the kernel's ephemeral range, a slice per test process."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

from tests import ports


def test_ports_lie_below_the_ephemeral_range_and_do_not_repeat_soon():
    handed = [ports.free_port() for _ in range(200)]
    assert len(set(handed)) == 200
    assert all(ports.FIRST_PORT <= p < ports._ephemeral_low() for p in handed)
    base = ports.free_ports(4)
    assert base + 4 <= ports._ephemeral_low()
    assert not set(range(base, base + 4)) & set(handed)


def _slice_of(worker: str, count: int) -> range:
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_WORKER_COUNT": str(count)}
    out = subprocess.run(
        [sys.executable, "-c", "from tests import ports; r = ports._SLICE; print(r.start, r.stop)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return range(int(out[0]), int(out[1]))


def test_each_test_process_draws_from_its_own_slice():
    slices = [_slice_of(f"gw{i}", 3) for i in range(3)]
    for a, b in itertools.pairwise(slices):
        assert a.stop <= b.start
    assert slices[0].start == ports.FIRST_PORT
    assert slices[-1].stop <= ports._ephemeral_low()
