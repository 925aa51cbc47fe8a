"""The examples of docs/rest.md, run as written against a CLI worker's REST port.

Each ``bash`` block runs in ``bash -e`` with ``localhost:8000`` pointed at the worker (curl is
the real one); the ``json`` or ``text`` block right after it is the output it must print (JSON
compared as values, text exactly). The ``python`` block runs with ``tritonclient.http``.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.e2e.conftest import WorkerProcess
from tests.ports import free_port

pytestmark = pytest.mark.slow

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "rest.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def examples() -> list[tuple[str, str, str | None, str | None]]:
    """(language, code, expected language, expected output) for each runnable block."""
    text = DOC.read_text()
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in BLOCK.finditer(text)]
    out = []
    for i, (lang, code, _, end) in enumerate(blocks):
        if lang not in ("bash", "python"):
            continue
        expected = expected_lang = None
        if i + 1 < len(blocks) and blocks[i + 1][0] in ("json", "text"):
            if not text[end : blocks[i + 1][2]].strip():
                expected_lang, expected = blocks[i + 1][0], blocks[i + 1][1]
        out.append((lang, code, expected_lang, expected))
    return out


@pytest.fixture(scope="module")
def worker(demo_repo):
    port = free_port()
    w = WorkerProcess(demo_repo, "--http-port", str(port))
    w.http_port = port
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


def test_the_doc_has_curl_examples_with_outputs():
    found = examples()
    assert sum("curl" in code for _, code, _, _ in found) >= 6
    assert sum(expected is not None for *_, expected in found) >= 6


def test_every_example_runs_as_documented(worker, tmp_path):
    assert shutil.which("curl"), "the doc examples need curl"
    for lang, code, expected_lang, expected in examples():
        code = code.replace("localhost:8000", f"127.0.0.1:{worker.http_port}")
        cmd = ["bash", "-e", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{code}\n{done.stdout}\n{done.stderr}"
        if expected_lang == "json":
            assert json.loads(done.stdout) == json.loads(expected), code
        elif expected_lang == "text":
            assert done.stdout.strip() == expected.strip(), code
        elif lang == "python":
            assert done.stdout.strip() == "[2. 4. 6. 8.]"
        else:  # an example without a printed result still answers JSON
            assert json.loads(done.stdout), code
