"""The ``gate`` meta model: a request that holds a CLI worker's device thread until the test
opens the gate, so that requests queue behind it for as long as the test needs.

A model that sleeps a fixed time races the test: a loaded machine can outlast the sleep
before the test has queued, cancelled or measured what it came for. The gate's request runs
until the test calls ``Gate.open`` (or ``GATE_BOUND_SECONDS``, a bound for a test that fails
before it opens it). The model and the test meet through two files in a directory outside the
model repository: ``started`` (the request is on the device) and ``open``.
"""

from __future__ import annotations

import pathlib

from tests.waiting import wait_until

GATE_BOUND_SECONDS = 120.0

GATE_MODEL_PY = """\
import pathlib
import time

from kserve_trio.core.tensors.tensor import NamedTensor

GATE = pathlib.Path({gate!r})


def run(inputs, call):
    (seconds,) = inputs
    (GATE / "open").unlink(missing_ok=True)  # an opening left from an earlier hold
    (GATE / "started").touch()
    give_up = time.monotonic() + {bound!r}
    while not (GATE / "open").exists() and time.monotonic() < give_up:
        time.sleep(0.005)
    (GATE / "started").unlink(missing_ok=True)
    (GATE / "open").unlink(missing_ok=True)
    return [NamedTensor.from_array("slept", seconds.data.copy())]


register_meta_model("gate", run=run)
"""
"""Its input and output are ``sleepy``'s (``seconds``, ignored, and ``slept``)."""


class Gate:
    """The ``gate`` model's hold on the device thread: its request runs until ``open``."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.dir = directory

    def wait_started(self) -> None:
        """Block until the gate's request runs on the device thread."""
        wait_until(lambda: (self.dir / "started").exists(), timeout=60, what="gate on device")

    def holding(self) -> bool:
        return (self.dir / "started").exists()

    def open(self) -> None:
        """Let the request holding the device thread finish, if one does (the gate closes
        again after it)."""
        if self.holding():
            (self.dir / "open").touch()


def add_gate_model(repo: pathlib.Path) -> Gate:
    """Write the ``gate`` model into the repository ``repo``; its files meet the test in a
    directory beside ``repo``."""
    from tests.e2e.test_protocol_features_e2e import SLEEPY_MANIFEST

    meet = repo.parent / "gate"
    meet.mkdir()
    (repo / "gate").mkdir()
    (repo / "gate" / "model.py").write_text(
        GATE_MODEL_PY.format(gate=str(meet), bound=GATE_BOUND_SECONDS)
    )
    (repo / "gate" / "manifest.yaml").write_text(SLEEPY_MANIFEST)
    return Gate(meet)


__all__ = ["GATE_BOUND_SECONDS", "GATE_MODEL_PY", "Gate", "add_gate_model"]
