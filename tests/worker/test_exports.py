"""The worker's public surface (each package states it once in its ``__init__``; this test pins it)."""

from __future__ import annotations

import subprocess
import sys

import kserve_trio.worker as worker

EXPECTED = {
    "RunningServer",
    "register_heartbeat",
    "register_meta_model",
    "register_model",
    "register_serve_guard",
    "serve",
    "serve_worker",
    "stop",
}


def test_worker_exports_exactly_its_public_surface():
    assert set(worker.__all__) == EXPECTED
    for name in EXPECTED:
        assert callable(getattr(worker, name)) or isinstance(getattr(worker, name), type)


def test_importing_the_worker_package_does_not_import_jax():
    code = "import sys, kserve_trio.worker; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
