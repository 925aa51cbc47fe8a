"""The README's Python snippets run as written against a live CLI worker.

Each ```python block of README.md is executed in its own interpreter (the client keeps
process-wide state), with the README's address ``127.0.0.1:8001`` replaced by the test worker's.
What a snippet promises in a comment after a printed ``.shape`` is checked against the output.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:8001"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def promised_shapes(snippet: str) -> list[str]:
    """Shapes a snippet's comments promise after a printed ``.shape``, e.g. ``# (4, 8)``."""
    return re.findall(r"\.shape\)\s*#\s*(\(\d+(?:, \d+)*\))", snippet)


def test_readme_has_the_client_snippets():
    snippets = python_snippets()
    assert len(snippets) >= 2
    assert all(README_ADDRESS in s for s in snippets)


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_readme_snippet_runs_against_a_live_worker(index, demo_worker):
    snippet = python_snippets()[index]
    code = snippet.replace(README_ADDRESS, demo_worker.url)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.strip(), "the snippet printed nothing"
    shapes = promised_shapes(snippet)
    assert shapes, "the snippet promises no shape"
    for shape in shapes:
        assert shape in out, out
    if "is_server_ready()" in snippet:
        assert out.startswith("True"), out
