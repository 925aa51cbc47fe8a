"""Merging Prometheus expositions, checked with prometheus_client's own parser on real
expositions from prometheus_client registries."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kserve_trio.serving.metrics_merge import (
    ExpositionError,
    add_worker_label,
    label_names,
    merge_expositions,
    split_sample,
)


def worker_exposition(worker: str, requests: int, latency: float) -> str:
    r = CollectorRegistry()
    c = Counter("worker_requests_total", "ModelInfer requests", ["model", "worker"], registry=r)
    c.labels(model="m", worker=worker).inc(requests)
    h = Histogram(
        "worker_request_latency_seconds", "latency", ["worker"], buckets=(0.1, 1.0), registry=r
    )
    h.labels(worker=worker).observe(latency)
    Gauge("worker_up", "help of " + worker, ["worker"], registry=r).labels(worker=worker).set(1)
    return generate_latest(r).decode()


def gateway_exposition() -> str:
    r = CollectorRegistry()
    Gauge("gateway_worker_metrics_up", "scrape ok", ["worker"], registry=r).labels(worker="w0").set(
        1
    )
    Summary("gateway_sizes", "sizes", registry=r).observe(3)
    return generate_latest(r).decode()


def families(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name not in out, f"family {fam.name} appears twice"
        out[fam.name] = fam
    return out


def test_merged_expositions_parse_with_one_family_each_and_all_samples():
    merged = merge_expositions(
        [gateway_exposition(), worker_exposition("w0", 3, 0.05), worker_exposition("w1", 5, 0.5)]
    )
    fams = families(merged)
    assert merged.count("# TYPE worker_request_latency_seconds histogram") == 1
    assert merged.count("# HELP worker_requests_total ") == 1
    requests = {s.labels["worker"]: s.value for s in fams["worker_requests"].samples}
    assert requests == {"w0": 3.0, "w1": 5.0}
    hist = fams["worker_request_latency_seconds"]
    assert hist.type == "histogram"
    by_worker = {}
    for s in hist.samples:
        by_worker.setdefault(s.labels["worker"], set()).add(s.name)
    assert (
        by_worker["w0"]
        == by_worker["w1"]
        == {
            "worker_request_latency_seconds_bucket",
            "worker_request_latency_seconds_sum",
            "worker_request_latency_seconds_count",
        }
    )
    assert fams["gateway_sizes"].type == "summary"
    assert fams["gateway_worker_metrics_up"].samples[0].value == 1.0


def test_the_first_help_and_type_win_and_samples_follow_their_family():
    merged = merge_expositions([worker_exposition("w0", 1, 0.1), worker_exposition("w1", 1, 0.1)])
    assert "# HELP worker_up help of w0" in merged and "help of w1" not in merged
    lines = merged.splitlines()
    start = lines.index("# TYPE worker_up gauge")
    block = lines[start + 1 : start + 3]
    assert all(line.startswith("worker_up{") for line in block)  # both workers' samples


def test_histogram_parts_stay_with_their_family_even_when_interleaved():
    a = (
        "# HELP lat latency\n# TYPE lat histogram\n"
        'lat_bucket{le="+Inf"} 2\nlat_count 2\n'
        "# TYPE other gauge\nother 1\n"
        "lat_sum 0.5\n"  # after another family was declared
    )
    b = '# TYPE lat histogram\nlat_bucket{le="+Inf",w="b"} 1\nlat_sum{w="b"} 1\nlat_count{w="b"} 1\n'
    merged = merge_expositions([a, b])
    fams = families(merged)
    names = sorted(s.name for s in fams["lat"].samples)
    assert names == ["lat_bucket", "lat_bucket", "lat_count", "lat_count", "lat_sum", "lat_sum"]
    assert [s.value for s in fams["other"].samples] == [1.0]


def test_untyped_samples_and_families_without_samples_survive():
    merged = merge_expositions(
        ["# HELP empty_total nothing yet\n# TYPE empty_total counter\n", "loose_metric 4\n"]
    )
    fams = families(merged)
    assert fams["loose_metric"].samples[0].value == 4.0
    assert "# TYPE empty_total counter" in merged


def test_a_repeated_series_is_kept_once_and_a_conflicting_type_is_dropped():
    first = '# TYPE x gauge\nx{a="1"} 1\n'
    again = '# TYPE x gauge\nx{a="1"} 2\nx{a="2"} 3\n'
    other = '# TYPE x counter\nx{a="3"} 9\n'
    fams = families(merge_expositions([first, again, other]))
    assert {s.labels["a"]: s.value for s in fams["x"].samples} == {"1": 1.0, "2": 3.0}
    assert fams["x"].type == "gauge"


def test_label_values_with_braces_spaces_and_quotes_are_not_split():
    line = 'm{path="/a}b c",q="say \\"hi\\"",} 1.5 1700000000000'
    assert split_sample(line) == ("m", '{path="/a}b c",q="say \\"hi\\"",}', "1.5 1700000000000")
    assert split_sample("plain 2") == ("plain", "", "2")
    assert label_names('{path="/a}b c",q="say \\"hi\\"",}') == ["path", "q"]
    merged = merge_expositions([f"# TYPE m gauge\n{line}\n"])
    (sample,) = families(merged)["m"].samples
    assert sample.labels == {"path": "/a}b c", "q": 'say "hi"'}


@pytest.mark.parametrize("line", ['{a="1"} 1', 'm{a="1" 1', "m", 'm{a="1"}'])
def test_malformed_sample_lines_raise(line):
    with pytest.raises(ExpositionError):
        merge_expositions([line + "\n"])


def test_nothing_merges_to_nothing():
    assert merge_expositions([]) == "" and merge_expositions(["", "# just a comment\n"]) == ""


def test_add_worker_label_labels_only_samples_without_one():
    text = '# HELP a help\n# TYPE a gauge\na 1\na{x="1"} 2\na{worker="own",x="2"} 3\na{x="3",} 4\n'
    labelled = add_worker_label(text, 'gpu"0')
    fams = families(labelled)
    assert [s.labels for s in fams["a"].samples] == [
        {"worker": 'gpu"0'},
        {"x": "1", "worker": 'gpu"0'},
        {"worker": "own", "x": "2"},
        {"x": "3", "worker": 'gpu"0'},
    ]
    assert labelled.startswith("# HELP a help\n# TYPE a gauge\n")


def test_two_unlabelled_workers_do_not_collide_once_labelled():
    bare = "# TYPE process_open_fds gauge\nprocess_open_fds 7\n"
    merged = merge_expositions([add_worker_label(bare, "w0"), add_worker_label(bare, "w1")])
    samples = families(merged)["process_open_fds"].samples
    assert sorted(s.labels["worker"] for s in samples) == ["w0", "w1"]
