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


@pytest.fixture
def restored_logging():
    """Run a test that reconfigures logging, then put the suite's configuration back."""
    import structlog

    from kserve_trio.core import logging as klog

    saved = structlog.get_config()
    saved_state = dict(klog._state)
    yield
    structlog.configure(**saved)
    klog._state.clear()
    klog._state.update(saved_state)


def _events(stream: io.StringIO) -> list[str]:
    lines = [ln for ln in stream.getvalue().splitlines() if ln.strip()]
    stream.seek(0)
    stream.truncate()
    return lines


def test_log_settings_switch_levels_independently_and_change_the_format(restored_logging):
    from kserve_trio.core.logging import current_log_settings, update_log_settings

    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    log = get_logger("t")
    settings = current_log_settings()
    assert (settings.log_info, settings.log_warning, settings.log_error) == (True, True, True)
    assert (settings.log_verbose_level, settings.log_format, settings.log_file) == (0, "json", "")

    update_log_settings({"log_info": False})
    log.debug("d1"), log.info("i1"), log.warning("w1"), log.error("e1")
    assert [json.loads(ln)["event"] for ln in _events(stream)] == ["w1", "e1"]

    update_log_settings({"log_warning": False, "log_verbose_level": 2})
    log.debug("d2"), log.info("i2"), log.warning("w2"), log.error("e2")
    assert [json.loads(ln)["event"] for ln in _events(stream)] == ["d2", "e2"]

    settings = update_log_settings({"log_format": "ISO8601", "log_info": True})
    assert settings.log_format == "ISO8601"
    log.info("i3", model="m")
    (line,) = _events(stream)
    assert "i3" in line and "model=m" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)
    assert update_log_settings({"log_format": "default"}).log_format == "json"


def test_log_settings_are_validated_all_or_nothing(restored_logging):
    from kserve_trio.core.errors import InvalidArgument
    from kserve_trio.core.logging import current_log_settings, update_log_settings

    configure_logging("json", "info", stream=io.StringIO())
    before = current_log_settings()
    bad = [
        ({"log_info": False, "log_color": True}, "unknown log setting 'log_color'"),
        ({"log_info": 1}, "log setting 'log_info' must be a bool"),
        ({"log_verbose_level": True}, "log setting 'log_verbose_level' must be a int"),
        ({"log_format": "xml"}, "log setting 'log_format' must be one of"),
        ({"log_file": "/tmp/x.log"}, "log setting 'log_file' is not supported"),
    ]
    for changes, message in bad:
        with pytest.raises(InvalidArgument, match=message):
            update_log_settings(changes)
        assert current_log_settings() == before
    assert update_log_settings({"log_file": ""}) == before


class _Writes(io.StringIO):
    """A stream that records each ``write`` call, as the OS would see them unbuffered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_log_line_is_one_write_newline_included():
    """Processes that share one output (a gateway's children, a node's) interleave only whole
    lines: a line written as message and newline in two calls could be split by another's."""
    stream = _Writes()
    configure_logging("json", "info", stream=stream)
    log = get_logger("kserve_trio.test")
    log.info("first_event", n=1)
    log.info("second_event", n=2)
    assert len(stream.calls) == 2
    for call, event in zip(stream.calls, ("first_event", "second_event"), strict=True):
        assert call.endswith("\n") and call.count("\n") == 1
        assert json.loads(call)["event"] == event
