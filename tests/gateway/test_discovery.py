"""Discovery: every (address, port) of every endpoints entry is a worker; names re-resolve;
metrics endpoints pair by address, then position; the diff between rounds."""

from __future__ import annotations

import anyio
import pytest

from kserve_trio.gateway.config import GatewayConfig
from kserve_trio.gateway.fleet.discovery import (
    Discovery,
    WorkerDiff,
    WorkerSpec,
    diff_workers,
    expand_workers,
    system_resolver,
)

pytestmark = pytest.mark.anyio


class FakeDns:
    """A resolver hook with a mutable table; ``calls`` records what was asked."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.calls: list[tuple[str, int]] = []
        self.fail: set[str] = set()
        self.hang: set[str] = set()

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host in self.hang:
            await anyio.sleep_forever()
        if host in self.fail or host not in self.table:
            raise OSError(f"cannot resolve {host}")
        return list(self.table[host])


def labels(workers) -> list[str]:
    return [w.label for w in workers]


# --------------------------------------------------------------------------------------------
# expand_workers (pure)


def test_each_address_of_each_entry_is_one_worker_labelled_ip_port():
    workers = expand_workers(
        [("svc.test", 8001), ("10.0.0.9", 8001)],
        [["10.0.0.2", "10.0.0.1", "10.0.0.2"], ["10.0.0.9"]],
    )
    assert labels(workers) == ["10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.9:8001"]
    assert [w.entry for w in workers] == [0, 0, 1]
    assert workers[0] == WorkerSpec("10.0.0.1", 8001, "svc.test", 0, "10.0.0.1:8001", None)
    assert workers[0].key == ("10.0.0.1", 8001)


def test_workers_are_ordered_by_address_whatever_order_the_resolver_answers_in():
    a = expand_workers([("s", 1)], [["10.0.0.10", "10.0.0.9", "::1"]])
    b = expand_workers([("s", 1)], [["::1", "10.0.0.9", "10.0.0.10"]])
    assert a == b
    assert labels(a) == ["10.0.0.9:1", "10.0.0.10:1", "[::1]:1"]  # numeric, IPv4 first


def test_an_address_port_already_seen_in_an_earlier_entry_is_not_repeated():
    workers = expand_workers(
        [("a", 1), ("b", 1), ("c", 2)], [["10.0.0.1"], ["10.0.0.1"], ["10.0.0.1"]]
    )
    assert labels(workers) == ["10.0.0.1:1", "10.0.0.1:2"]
    assert [w.host for w in workers] == ["a", "c"]


def test_names_label_single_workers_and_qualify_several():
    workers = expand_workers(
        [("one", 1), ("many", 2), ("none", 3)],
        [["10.0.0.1"], ["10.0.0.3", "10.0.0.2"], []],
        names=["gpu0", "pool", "empty"],
    )
    assert labels(workers) == ["gpu0", "pool/10.0.0.2:2", "pool/10.0.0.3:2"]


def test_ipv6_workers_are_bracketed():
    (w,) = expand_workers([("v6", 9)], [["fe80::1"]])
    assert w.label == w.target == "[fe80::1]:9"


def test_metrics_pair_by_address_then_by_position():
    workers = expand_workers(
        [("svc", 8001), ("gpu", 8001), ("lonely", 8001)],
        [["10.0.0.1", "10.0.0.2", "10.0.0.3"], ["10.0.1.1"], ["10.0.2.1", "10.0.2.2"]],
        metrics=[("svc-metrics", 9090), ("gpu-metrics", 9091), ("m", 9092)],
        metrics_resolved=[["10.0.0.3", "10.0.9.9", "10.0.0.1"], ["10.0.1.7"], ["10.0.2.2"]],
    )
    got = {w.label: w.metrics for w in workers}
    assert got == {
        "10.0.0.1:8001": ("10.0.0.1", 9090),  # same address
        "10.0.0.2:8001": ("10.0.9.9", 9090),  # the left-over one, by position
        "10.0.0.3:8001": ("10.0.0.3", 9090),
        "10.0.1.1:8001": ("10.0.1.7", 9091),  # one each side: position
        "10.0.2.1:8001": None,  # nothing left for it
        "10.0.2.2:8001": ("10.0.2.2", 9092),
    }
    assert workers[1].metrics_target == "10.0.9.9:9090"


def test_without_metrics_endpoints_no_worker_has_one():
    workers = expand_workers([("a", 1)], [["10.0.0.1"]])
    assert workers[0].metrics is None and workers[0].metrics_target is None


# --------------------------------------------------------------------------------------------
# diff_workers (pure)


def test_the_diff_lists_added_removed_and_changed_workers():
    w = lambda addr, label=None, entry=0: WorkerSpec(addr, 1, "h", entry, label or f"{addr}:1")  # noqa: E731
    old = [w("10.0.0.1"), w("10.0.0.2"), w("10.0.0.3")]
    new = [w("10.0.0.2", "renamed"), w("10.0.0.3"), w("10.0.0.4")]
    diff = diff_workers(old, new)
    assert [x.address for x in diff.added] == ["10.0.0.4"]
    assert [x.address for x in diff.removed] == ["10.0.0.1"]
    assert diff.changed == ((w("10.0.0.2"), w("10.0.0.2", "renamed")),)
    assert not diff.empty
    assert diff_workers(new, new) == WorkerDiff() and diff_workers(new, new).empty


# --------------------------------------------------------------------------------------------
# Discovery (the async shell)


async def test_one_name_resolving_to_two_loopback_addresses_is_two_workers():
    dns = FakeDns({"workers.test": ["127.0.0.1", "127.0.0.2"]})
    discovery = Discovery(["workers.test:9001"], resolver=dns)
    first = await discovery.refresh()
    assert labels(first.workers) == ["127.0.0.1:9001", "127.0.0.2:9001"]
    assert labels(first.diff.added) == labels(first.workers) and not first.diff.removed
    assert all(w.host == "workers.test" for w in first.workers)

    dns.table["workers.test"] = ["127.0.0.2"]  # a pod went away
    second = await discovery.refresh()
    assert labels(second.workers) == ["127.0.0.2:9001"]
    assert labels(second.diff.removed) == ["127.0.0.1:9001"] and not second.diff.added
    assert discovery.workers == second.workers

    dns.table["workers.test"] = ["127.0.0.3", "127.0.0.2"]  # and another came
    third = await discovery.refresh()
    assert labels(third.diff.added) == ["127.0.0.3:9001"] and not third.diff.removed
    assert dns.calls == [("workers.test", 9001)] * 3  # re-resolved every round


async def test_a_failed_resolution_keeps_that_entrys_workers_and_is_reported():
    dns = FakeDns({"a.test": ["127.0.0.1"], "b.test": ["127.0.0.2"]})
    discovery = Discovery(["a.test:1", "b.test:1"], resolver=dns)
    await discovery.refresh()
    dns.fail.add("a.test")
    dns.table["b.test"] = []
    result = await discovery.refresh()
    assert labels(result.workers) == ["127.0.0.1:1"]  # a kept; b resolved to nothing
    assert result.failures == (("a.test:1", "cannot resolve a.test"),)
    assert labels(result.diff.removed) == ["127.0.0.2:1"]


async def test_a_resolver_that_hangs_is_bounded_and_counts_as_failed():
    dns = FakeDns({"slow.test": ["127.0.0.1"]})
    dns.hang.add("slow.test")
    discovery = Discovery(["slow.test:1", "127.0.0.5:2"], resolver=dns, timeout=0.05)
    with anyio.fail_after(5):
        result = await discovery.refresh()
    assert labels(result.workers) == ["127.0.0.5:2"]
    assert result.failures == (("slow.test:1", "no answer within 0.05s"),)


async def test_ip_literals_are_not_resolved():
    dns = FakeDns({})
    discovery = Discovery(
        ["127.0.0.1:1", "[::1]:2"], metrics=["127.0.0.1:3", "[::1]:4"], resolver=dns
    )
    result = await discovery.refresh()
    assert dns.calls == []
    assert [(w.label, w.metrics_target) for w in result.workers] == [
        ("127.0.0.1:1", "127.0.0.1:3"),
        ("[::1]:2", "[::1]:4"),
    ]


async def test_from_config_carries_names_and_metrics():
    cfg = GatewayConfig(
        endpoints=("pool.test:8001",),
        worker_names=("pool",),
        worker_metrics=("pool.test:9090",),
    )
    dns = FakeDns({"pool.test": ["127.0.0.2", "127.0.0.1"]})
    result = await Discovery.from_config(cfg, resolver=dns).refresh()
    assert [(w.label, w.metrics_target) for w in result.workers] == [
        ("pool/127.0.0.1:8001", "127.0.0.1:9090"),
        ("pool/127.0.0.2:8001", "127.0.0.2:9090"),
    ]


async def test_the_system_resolver_resolves_localhost_to_the_loopback_address():
    addresses = await system_resolver("localhost", 8001)
    assert "127.0.0.1" in addresses
    assert all(":" not in a for a in addresses)  # IPv4 preferred when there is any
    result = await Discovery(["localhost:8001"]).refresh()
    assert "127.0.0.1:8001" in labels(result.workers)
    assert all(w.host == "localhost" for w in result.workers)


async def test_the_system_resolver_reports_an_unknown_name_as_a_failure():
    result = await Discovery(["no-such-host.invalid:1"]).refresh()
    assert result.workers == ()
    ((entry, reason),) = result.failures
    assert entry == "no-such-host.invalid:1" and reason
