"""The committed generated code matches ``protos/``, and the layering holds: the lower layers
import neither jax nor any server code."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_proto_code_is_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _has_modules(package: str) -> bool:
    """Whether a package contains any module besides its ``__init__``."""
    try:
        pkg = importlib.import_module(package)
    except ModuleNotFoundError:
        return False
    return any(True for _ in pkgutil.iter_modules(pkg.__path__))


# Each layer lists what it must never load: third-party stacks and the project's own packages
# above it. Only ``runtime`` and ``export`` (and ``worker``, which stands on ``runtime``) may load
# jax. A package joins once it has modules.
_JAX = ("jax", "jaxlib")
_ABOVE_CORE = (
    "kserve_trio.client",
    "kserve_trio.runtime",
    "kserve_trio.export",
    "kserve_trio.serving",
    "kserve_trio.worker",
    "kserve_trio.gateway",
    "kserve_trio.node",
)
_DOMAINS = (
    "kserve_trio.core.bundles",
    "kserve_trio.core.memory",
    "kserve_trio.core.process",
    "kserve_trio.core.protocol",
)
LAYERS = {
    "kserve_trio.core": (*_JAX, "h2.connection", "ngh2", *_ABOVE_CORE),
    # core's domains import down: tensors < bundles, memory < process < protocol (core/__init__)
    "kserve_trio.core.tensors": (*_JAX, *_DOMAINS, *_ABOVE_CORE),
    "kserve_trio.core.bundles": (*_JAX, *_DOMAINS[1:], *_ABOVE_CORE),
    "kserve_trio.core.memory": (*_JAX, _DOMAINS[0], *_DOMAINS[2:], *_ABOVE_CORE),
    "kserve_trio.core.process": (*_JAX, _DOMAINS[0], _DOMAINS[3], *_ABOVE_CORE),
    "kserve_trio.core.protocol": (*_JAX, _DOMAINS[0], *_ABOVE_CORE),
    # the engine seam sits beside core; its engines load only when asked for (one per process)
    "kserve_trio.http2": (*_JAX, "kserve_trio.core", *_ABOVE_CORE),
    "kserve_trio.proto": (*_JAX, "h2.connection", "kserve_trio.core", *_ABOVE_CORE),
}
if _has_modules("kserve_trio.client"):
    LAYERS["kserve_trio.client"] = (*_JAX, "h2.connection", *_ABOVE_CORE[1:])
if _has_modules("kserve_trio.serving"):
    LAYERS["kserve_trio.serving"] = (
        *_JAX,
        "kserve_trio.runtime",
        "kserve_trio.export",
        "kserve_trio.worker",
        "kserve_trio.gateway",
        "kserve_trio.node",
    )
for _layer in ("kserve_trio.gateway", "kserve_trio.node"):
    if _has_modules(_layer):
        LAYERS[_layer] = (*_JAX, "kserve_trio.runtime", "kserve_trio.export", "kserve_trio.worker")
if _has_modules("kserve_trio.frontend"):  # a worker's front end holds no model: no jax
    LAYERS["kserve_trio.frontend"] = (
        *_JAX,
        "kserve_trio.runtime",
        "kserve_trio.export",
        "kserve_trio.worker",
        "kserve_trio.gateway",
        "kserve_trio.node",
    )
if "kserve_trio.gateway" in LAYERS:  # the node supervisor embeds the gateway, never the reverse
    LAYERS["kserve_trio.gateway"] += ("kserve_trio.node",)

_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module({package!r})
names = [package.__name__]
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
    names.append(info.name)
forbidden = {forbidden!r}
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(json.dumps({{"imported": names, "forbidden_loaded": loaded}}))
"""


@pytest.mark.parametrize(("package", "forbidden"), LAYERS.items(), ids=LAYERS.keys())
def test_layer_imports_nothing_it_must_not(package, forbidden):
    import json

    result = subprocess.run(
        [sys.executable, "-c", _PROBE.format(package=package, forbidden=list(forbidden))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert package in report["imported"]
    assert report["forbidden_loaded"] == [], (
        f"importing {package} and its modules loaded {report['forbidden_loaded']}"
    )


def test_the_probe_detects_a_forbidden_import():
    """The layering check can fail: h2's connection module is visible when something loads it."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import h2.connection\n"
            + _PROBE.format(package="kserve_trio.proto", forbidden=["h2.connection"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert '"forbidden_loaded": ["h2.connection"]' in result.stdout
