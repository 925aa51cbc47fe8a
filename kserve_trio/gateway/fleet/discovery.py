"""Which workers exist: ``endpoints`` entries resolved to one worker per (address, port).

A gateway in a cluster is usually given names, not addresses: a Kubernetes headless Service
resolves to one address per ready pod, and that set changes as pods come and go. So each
``endpoints`` entry is resolved every prober round and every (address, port) it yields is one
worker; ``expand_workers`` (pure) turns the resolutions into the worker set and ``diff_workers``
(pure) says which workers appeared, vanished or changed since the last round. ``Discovery`` is
the thin async shell that runs the resolver.

The resolver is a hook: any ``async resolve(host, port) -> list[str]`` of addresses, passed to
``Discovery`` (tests make one name resolve to 127.0.0.1 and 127.0.0.2 with it);
``hosts_file_resolver`` is the one a gateway process uses when
``KSERVE_TRIO_GATEWAY_HOSTS_FILE`` names a file in the ``/etc/hosts`` format. The default,
``system_resolver``, asks the system (``anyio.getaddrinfo``, so ``/etc/hosts`` and DNS) and
keeps the IPv4 addresses when there are any, else the IPv6 ones: a dual-stack ``localhost``
would otherwise count as two workers, one of them usually not listening. IP literals are never
passed to the resolver.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio

from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.addresses import format_host_port, is_ip_literal, parse_host_port
from kserve_trio.gateway.config import GatewayConfig

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``async resolve(host, port) -> [address, ...]``; raising ``OSError`` means "failed"."""

RESOLVE_TIMEOUT_SECONDS = 5.0
"""A resolution that takes longer counts as failed (the system resolver can hang on DNS)."""

_log = get_logger(__name__)


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses the system resolves ``host`` to: IPv4 ones if any, else IPv6 ones, each
    once, in the resolver's order."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4: list[str] = []
    v6: list[str] = []
    for family, _type, _proto, _name, sockaddr in infos:
        bucket = v4 if family == socket.AF_INET else v6 if family == socket.AF_INET6 else None
        address = str(sockaddr[0])
        if bucket is not None and address not in bucket:
            bucket.append(address)
    return v4 or v6


def parse_hosts(text: str) -> dict[str, list[str]]:
    """An ``/etc/hosts``-format text as name (lowercased) -> addresses, in file order: each
    line is an address and its names; ``#`` starts a comment; a line whose first field is not
    an IP address is ignored."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2 or not is_ip_literal(fields[0]):
            continue
        for name in fields[1:]:
            addresses = out.setdefault(name.lower(), [])
            if fields[0] not in addresses:
                addresses.append(fields[0])
    return out


def hosts_file_resolver(path: str, fallback: Resolver = system_resolver) -> Resolver:
    """A resolver that reads ``path`` (``/etc/hosts`` format, ``parse_hosts``) on every call:
    a name it lists resolves to the addresses listed for it, any other name goes to
    ``fallback``. Editing the file changes the answer at the next prober round, which makes
    one name stand for a changing set of addresses without a DNS server. A file that cannot
    be read counts as empty."""

    async def resolve(host: str, port: int) -> list[str]:
        try:
            text = await anyio.Path(path).read_text()
        except OSError as exc:
            _log.warning("hosts_file_unreadable", path=path, error=str(exc))
            text = ""
        listed = parse_hosts(text).get(host.lower())
        if listed:
            return listed
        return await fallback(host, port)

    return resolve


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: the address it resolved to, the ``endpoints`` entry it came from, its label,
    its paired metrics endpoint and its paired KServe V2 REST endpoint (``http``; ``None``:
    none configured or none paired).

    ``host`` is the entry's host as written: the name its TLS certificate is checked against
    (on its REST port too).
    """

    address: str
    port: int
    host: str
    entry: int
    label: str
    metrics: tuple[str, int] | None = None
    http: tuple[str, int] | None = None

    @property
    def key(self) -> tuple[str, int]:
        """What identifies the worker across rounds: its (address, port)."""
        return (self.address, self.port)

    @property
    def target(self) -> str:
        """``address:port`` (IPv6 in brackets), the default label."""
        return format_host_port(self.address, self.port)

    @property
    def metrics_target(self) -> str | None:
        return None if self.metrics is None else format_host_port(*self.metrics)

    @property
    def http_target(self) -> str | None:
        return None if self.http is None else format_host_port(*self.http)


def _address_order(address: str) -> tuple[int, int, str]:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (2, 0, address)
    return (ip.version, int(ip), address)


def _unique_sorted(addresses: Sequence[str]) -> list[str]:
    return sorted(set(addresses), key=_address_order)


def expand_workers(
    endpoints: Sequence[tuple[str, int]],
    resolved: Sequence[Sequence[str]],
    *,
    names: Sequence[str] = (),
    metrics: Sequence[tuple[str, int]] = (),
    metrics_resolved: Sequence[Sequence[str]] = (),
    http: Sequence[tuple[str, int]] = (),
    http_resolved: Sequence[Sequence[str]] = (),
) -> tuple[WorkerSpec, ...]:
    """The worker set of one round; ``resolved[i]`` are the addresses of ``endpoints[i]``.

    Rules:
    1. *One worker per address*: each distinct address of entry ``i``, with the entry's port, is one
       worker; within an entry workers are ordered by address (numerically, IPv4 first), so a
       resolver that rotates its answers does not reorder them.
    2. *First entry wins*: an (address, port) already produced by an earlier entry is not repeated
       (first wins).
    3. *Labels*: the label is ``names[i]`` when the entry is named and yields exactly one worker,
       ``names[i]/address:port`` for each when it yields several, else ``address:port``.
    4. *Metrics pairing*: with ``metrics`` (index-aligned with ``endpoints``), a worker of entry
       ``i`` is paired with the address of ``metrics[i]``'s resolution equal to its own; the workers
       left unpaired then take the entry's left-over metrics addresses by position (both in address
       order); a worker with nothing left has no metrics endpoint.
    5. *REST pairing*: ``http`` (the REST endpoints, index-aligned with ``endpoints``) pairs as
       *metrics pairing* does: a worker behind a name takes the REST address equal to its own, so
       one name with its REST port (``workers:8000`` next to ``workers:8001``) gives every
       discovered worker its own.
    """
    seen: set[tuple[str, int]] = set()
    out: list[WorkerSpec] = []
    for i, (host, port) in enumerate(endpoints):
        addresses = [a for a in _unique_sorted(resolved[i]) if (a, port) not in seen]
        seen.update((a, port) for a in addresses)
        name = names[i] if i < len(names) else ""
        paired = _pair(addresses, metrics, metrics_resolved, i)
        paired_http = _pair(addresses, http, http_resolved, i)
        for address in addresses:
            target = format_host_port(address, port)
            if not name:
                label = target
            else:
                label = name if len(addresses) == 1 else f"{name}/{target}"
            out.append(
                WorkerSpec(
                    address, port, host, i, label, paired.get(address), paired_http.get(address)
                )
            )
    return tuple(out)


def _pair(
    addresses: Sequence[str],
    metrics: Sequence[tuple[str, int]],
    metrics_resolved: Sequence[Sequence[str]],
    i: int,
) -> dict[str, tuple[str, int]]:
    if i >= len(metrics) or i >= len(metrics_resolved):
        return {}
    mport = metrics[i][1]
    candidates = _unique_sorted(metrics_resolved[i])
    paired = {a: (a, mport) for a in addresses if a in candidates}
    spare = [m for m in candidates if m not in paired]
    waiting = [a for a in addresses if a not in paired]
    for address, m in zip(waiting, spare, strict=False):
        paired[address] = (m, mport)
    return paired


@dataclass(frozen=True)
class WorkerDiff:
    """What changed between two worker sets: workers that appeared, that vanished, and those
    whose key stayed but whose label, entry, metrics or REST endpoint changed (``(old, new)``)."""

    added: tuple[WorkerSpec, ...] = ()
    removed: tuple[WorkerSpec, ...] = ()
    changed: tuple[tuple[WorkerSpec, WorkerSpec], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


def diff_workers(old: Sequence[WorkerSpec], new: Sequence[WorkerSpec]) -> WorkerDiff:
    """The difference from ``old`` to ``new``, keyed by (address, port), in each set's order."""
    before = {w.key: w for w in old}
    after = {w.key: w for w in new}
    return WorkerDiff(
        added=tuple(w for w in new if w.key not in before),
        removed=tuple(w for w in old if w.key not in after),
        changed=tuple((before[w.key], w) for w in new if w.key in before and before[w.key] != w),
    )


@dataclass(frozen=True)
class DiscoveryRound:
    """The outcome of one resolution round: the worker set, its difference from the previous
    round, and the entries that failed to resolve (``(entry text, reason)``; such an entry
    keeps the addresses it had, so a DNS hiccup does not drop its workers)."""

    workers: tuple[WorkerSpec, ...]
    diff: WorkerDiff
    failures: tuple[tuple[str, str], ...] = ()


class Discovery:
    """Resolves the configured entries into the current worker set (see the module docstring).

    ``refresh`` resolves every entry concurrently (each bounded by ``timeout`` seconds) and
    returns the round's ``DiscoveryRound``; ``workers`` is the latest set. Entries that are IP
    literals are not resolved.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        names: Sequence[str] = (),
        metrics: Sequence[str] = (),
        http: Sequence[str] = (),
        resolver: Resolver = system_resolver,
        timeout: float = RESOLVE_TIMEOUT_SECONDS,
    ) -> None:
        self._endpoints = [parse_host_port(e) for e in endpoints]
        self._metrics = [parse_host_port(m) for m in metrics]
        self._texts = [str(e).strip() for e in endpoints]
        self._metric_texts = [str(m).strip() for m in metrics]
        self._http = [parse_host_port(h) for h in http]
        self._http_texts = [str(h).strip() for h in http]
        self._names = tuple(names)
        self._resolver = resolver
        self._timeout = timeout
        self._last: dict[tuple[str, int], list[str]] = {}
        self.workers: tuple[WorkerSpec, ...] = ()

    @classmethod
    def from_config(cls, cfg: GatewayConfig, resolver: Resolver = system_resolver) -> Discovery:
        return cls(
            cfg.endpoints,
            names=cfg.worker_names,
            metrics=cfg.worker_metrics,
            http=cfg.worker_http_endpoints,
            resolver=resolver,
        )

    async def refresh(self) -> DiscoveryRound:
        """Resolve every entry and swap in the new worker set."""
        hosts = {(h, p): t for (h, p), t in zip(self._endpoints, self._texts, strict=True)}
        for extra, texts in ((self._metrics, self._metric_texts), (self._http, self._http_texts)):
            hosts.update({(h, p): t for (h, p), t in zip(extra, texts, strict=True)})
        results: dict[tuple[str, int], list[str]] = {}
        failures: list[tuple[str, str]] = []

        async def one(host: str, port: int) -> None:
            if is_ip_literal(host):
                results[(host, port)] = [host]
                return
            reason = ""
            with anyio.move_on_after(self._timeout) as scope:
                try:
                    addresses = [str(a) for a in await self._resolver(host, port)]
                except OSError as exc:
                    reason = str(exc) or type(exc).__name__
                else:
                    results[(host, port)] = addresses
                    self._last[(host, port)] = addresses
                    return
            if scope.cancelled_caught:
                reason = f"no answer within {self._timeout:g}s"
            failures.append((hosts[(host, port)], reason))
            results[(host, port)] = self._last.get((host, port), [])

        async with anyio.create_task_group() as tg:
            for host, port in hosts:
                tg.start_soon(one, host, port)
        for text, reason in failures:
            _log.warning("endpoint_resolution_failed", endpoint=text, reason=reason)
        workers = expand_workers(
            self._endpoints,
            [results[e] for e in self._endpoints],
            names=self._names,
            metrics=self._metrics,
            metrics_resolved=[results[m] for m in self._metrics],
            http=self._http,
            http_resolved=[results[h] for h in self._http],
        )
        diff = diff_workers(self.workers, workers)
        self.workers = workers
        return DiscoveryRound(workers, diff, tuple(sorted(failures)))


__all__ = [
    "RESOLVE_TIMEOUT_SECONDS",
    "Discovery",
    "DiscoveryRound",
    "Resolver",
    "WorkerDiff",
    "WorkerSpec",
    "diff_workers",
    "expand_workers",
    "hosts_file_resolver",
    "parse_hosts",
    "system_resolver",
]
