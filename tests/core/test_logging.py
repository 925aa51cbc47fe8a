"""core.logging: the quiet default and the configured renderers."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from kserve_trio.core.logging import configure_logging, get_logger, parse_level


def test_an_unconfigured_program_only_sees_warnings_from_the_library():
    code = (
        "from kserve_trio.core.logging import get_logger\n"
        "log = get_logger('x')\n"
        "log.debug('quiet_debug'); log.info('quiet_info'); log.warning('loud_warning')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "loud_warning" in out.stdout + out.stderr
    assert "quiet_debug" not in out.stdout + out.stderr
    assert "quiet_info" not in out.stdout + out.stderr


def test_configured_json_rendering_and_level_filter():
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    try:
        log = get_logger("t", worker="w0")
        log.debug("hidden")
        log.info("model_loaded", model="mlp")
    finally:
        import structlog

        structlog.reset_defaults()
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["model_loaded"]
    assert lines[0]["model"] == "mlp" and lines[0]["worker"] == "w0" and lines[0]["level"] == "info"


def test_parse_level():
    assert parse_level("DEBUG") == 10 and parse_level(" warning ") == 30 and parse_level(20) == 20
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        parse_level("loud")
