"""The Python blocks of every page under docs/, run as a reader would run them.

A page's blocks run in order in one fresh interpreter, in one namespace (a later block uses what
an earlier one defined, as the page reads), statement by statement: one with a
top-level ``await`` ("from async code") is awaited on an asyncio loop of its own, the others run
on the plain main thread (where ``infer_sync`` may block), as a block showing both forms means. The gRPC port ``8001`` is pointed at one
module-scoped CLI worker on the demo repository (at a gateway in front of it for
docs/gateway.md), which traces to a test OTLP receiver (docs/observability.md changes its trace
settings), the REST port ``8000`` at that worker's REST port, and the working directory
holds ``models/mlp`` (the demo bundle) and a ``gateway.yml`` naming the worker. A block that
registers hooks is a ``model.py``: it runs through the worker's own loader
(``registry.run_model_py``), which must record a registration.

A block that is not meant to run (a signature, a placeholder for the reader's own model, a
server of its own) carries ``<!-- not run: reason -->`` on the line before its fence; every
other Python block runs, so a new example is checked unless a reason is written down.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.e2e.conftest import WorkerProcess, free_port
from tests.otlp_receiver import otlp_receiver
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*\Z", re.S)
REGISTERS = re.compile(r"^register_(?:meta_)?model\(\"(\w+)\"", re.M)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    not_run: str | None  # the written reason, when the block is not meant to run

    @property
    def hook_name(self) -> str | None:
        """The bundle name a ``model.py`` block registers, else None."""
        m = REGISTERS.search(self.code)
        return m.group(1) if m else None


def python_blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    blocks, previous_end = [], 0
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            marked = NOT_RUN.search(text[previous_end : m.start()])
            blocks.append(
                Block(
                    page.name,
                    text.count("\n", 0, m.start()) + 1,
                    m.group(2),
                    marked.group(1) if marked else None,
                )
            )
        previous_end = m.end()
    return blocks


PAGES = sorted(p.name for p in DOCS.glob("*.md") if python_blocks(p))
RUN_PAGES = [p for p in PAGES if any(b.not_run is None for b in python_blocks(DOCS / p))]

RUNNER = r"""
import ast, asyncio, inspect, json, pathlib, re, sys

blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for i, block in enumerate(blocks):
    print(f"--- block {block['line']}", flush=True)
    if block["hook_name"]:
        from kserve_trio.worker.registry import run_model_py

        bundle = pathlib.Path(f"hooks-{i}")
        bundle.mkdir()
        (bundle / "model.py").write_text(block["code"])
        reg = run_model_py(bundle, block["hook_name"])
        assert reg is not None and reg.kind is not None, f"block {block['line']} registered nothing"
        continue
    where = f"<{block['page']}:{block['line']}>"
    for stmt in ast.parse(block["code"], where).body:  # a plain thread's, or async code's
        code = compile(ast.Module([stmt], []), where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            asyncio.run(result)
"""


def pointed(code: str, grpc_port: int, http_port: int) -> str:
    """The block with the docs' ports replaced by the test servers' ones."""
    code = re.sub(r"\b8001\b", str(grpc_port), code)
    return re.sub(r"\b8000\b", str(http_port), code)


class RestWorker(WorkerProcess):
    """The CLI worker with its REST port, which the docs call 8000."""

    http_port: int = 0


@pytest.fixture(scope="module")
def receiver():
    with otlp_receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def worker(demo_repo, receiver):
    http_port = free_port()
    # fifo: the lpt_packing gateway of docs/gateway.md refuses a fair-scheduling worker
    w = RestWorker(
        demo_repo,
        "--http-port",
        str(http_port),
        "--trace-level",
        "timestamps",
        "--trace-endpoint",
        receiver.url,
        env={"INFERENCE_SERVER_SCHEDULER_DISCIPLINE": "fifo"},
    )
    w.http_port = http_port
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


@pytest.fixture
def workdir(tmp_path, demo_repo, worker) -> pathlib.Path:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mlp").symlink_to(demo_repo / "mlp")
    (tmp_path / "gateway.yml").write_text(
        "listen: {grpc: '127.0.0.1:0', metrics: '127.0.0.1:0'}\n"
        f"endpoints: ['{worker.url}']\n"
        "scheduling: {mode: lpt_packing}\n"
    )
    return tmp_path


def test_every_python_block_runs_or_says_why_not():
    blocks = [b for page in PAGES for b in python_blocks(DOCS / page)]
    assert len(blocks) >= 16
    assert all(b.not_run for b in blocks if b.not_run is not None), "a reason is empty"
    run = [b for b in blocks if b.not_run is None]
    assert len(run) >= 10, [f"{b.page}:{b.line}" for b in blocks if b.not_run]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_page_runs_as_written_against_a_live_worker(page, worker, workdir, receiver):
    blocks = [b for b in python_blocks(DOCS / page) if b.not_run is None]
    grpc_port, gateway = worker.port, None
    if page == "gateway.md":
        from kserve_trio.gateway import serve_gateway, stop

        gateway = serve_gateway(str(workdir / "gateway.yml"), blocking=False)
        assert gateway is not None
        grpc_port = gateway.port
    payload = [
        {
            "page": b.page,
            "line": b.line,
            "code": pointed(b.code, grpc_port, worker.http_port),
            "hook_name": b.hook_name,
        }
        for b in blocks
    ]
    try:
        done = subprocess.run(
            [sys.executable, "-c", RUNNER],
            input=json.dumps(payload),
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(DOCS.parent)},
        )
    finally:
        if gateway is not None:
            stop(gateway)
    assert done.returncode == 0, f"{page}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.count("--- block ") == len(blocks), done.stdout
    if page == "gateway.md":  # the Repack completed and the status lists mlp's replica
        assert re.search(r"^True \{.*'mlp': \['", done.stdout, re.M), done.stdout
    if page == "rest.md":
        assert "[2. 4. 6. 8.]" in done.stdout
    if page == "observability.md":  # the caller's span is the worker span's parent
        assert "'trace_mode': ['opentelemetry']" in done.stdout, done.stdout
        (span,) = wait_until(
            lambda: [
                s
                for s in receiver.named("ModelInfer")
                if s.attributes.get("kserve_trio.request_id") == "traced-1"
            ],
            60,
            "the span of the page's traced request",
        )
        assert span.parent_span_id
