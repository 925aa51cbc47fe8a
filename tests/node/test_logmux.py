"""Line splitting and prefixing: whole lines, the partial last line, valid JSON after the prefix."""

from __future__ import annotations

import io
import json
import threading

from kserve_trio.node._logmux import LineSplitter, LogSink, prefixed


def test_lines_are_emitted_only_when_complete():
    s = LineSplitter()
    assert s.feed(b"abc") == []
    assert s.feed(b"def\nghi\n\njk") == [b"abcdef", b"ghi", b""]
    assert s.feed(b"l") == []
    assert s.flush() == [b"jkl"]
    assert s.flush() == []


def test_a_runaway_line_is_cut_at_the_cap():
    s = LineSplitter(max_line=4)
    assert s.feed(b"0123456789") == [b"0123", b"4567"]
    assert s.feed(b"\n") == [b"89"]


def test_prefix_strip_leaves_valid_json():
    record = json.dumps({"event": "server_up", "address": "127.0.0.1:8001", "n": [1, 2]})
    line = prefixed("worker0", record)
    assert line.startswith("[worker0] ") and line.endswith("\n")
    assert json.loads(line.removeprefix("[worker0] ")) == json.loads(record)


def test_sink_writes_whole_lines_from_many_threads():
    out = io.StringIO()
    sink = LogSink(out)

    def emit(name: str) -> None:
        for i in range(200):
            sink.child_bytes(name, json.dumps({"i": i, "pad": "x" * 100}).encode())

    threads = [threading.Thread(target=emit, args=(f"w{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.supervisor("done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 801
    for line in lines[:-1]:
        name, _, rest = line.partition("] ")
        assert name in ("[w0", "[w1", "[w2", "[w3")
        assert json.loads(rest)["pad"] == "x" * 100
    assert lines[-1] == "[supervisor] done"


def test_undecodable_bytes_do_not_break_the_sink():
    out = io.StringIO()
    LogSink(out).child_bytes("w", b"ok \xff\xfe end")
    assert out.getvalue() == "[w] ok \ufffd\ufffd end\n"


def test_a_closed_sink_is_ignored():
    out = io.StringIO()
    sink = LogSink(out)
    out.close()
    sink.supervisor("nobody listens")  # must not raise
