"""``tools/bench/tracing_off_path.py`` at a smoke size: it times every call site it lists, sums
each path from them, and measures a process where tracing is off and nothing of OpenTelemetry
has been imported (the state whose cost it states)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench" / "tracing_off_path.py"


def test_the_off_path_benchmark_times_every_site_of_every_path(tmp_path):
    out = tmp_path / "off_path.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--number", "200", "--repeat", "1", "--cpu-us", "400",
         "--gateway-cpu-us", "100", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    figures = json.loads(out.read_text())
    assert figures["opentelemetry_loaded"] == []
    sites = figures["sites"]
    assert all(f["cost_ns"] >= 0 and f["traced_ns"] > 0 for f in sites.values())
    paths = figures["paths"]
    assert {"worker gRPC ModelInfer (one process)", "gateway gRPC ModelInfer"} <= paths.keys()
    for path, total in paths.items():
        assert total["share"] == total["ns"] / ((100 if path.startswith("gateway") else 400) * 1e3)
        assert path in run.stdout
