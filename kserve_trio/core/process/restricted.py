"""Restricted protocols: RPC groups a request may call only when it carries a header
``key: value`` (Triton's ``--grpc-restricted-protocol`` / ``--http-restricted-api``).

A restriction is written as Triton writes it, ``group[,group...]:key=value``: the requests of
the named groups must carry metadata (gRPC) or a header (REST) ``key`` whose value is exactly
``value``, else they are refused PERMISSION_DENIED (REST 403) before their message is read.
Groups are Triton's names plus ours (``control``: the ``reactant_control`` services):

===================  ================================================================
``health``           ServerLive, ServerReady, ModelReady
``metadata``         ServerMetadata, ModelMetadata
``inference``        ModelInfer, ModelStreamInfer
``shared-memory``    System/CudaSharedMemory Status, Register, Unregister; IsSameIPCNamespace
``model-config``     ModelConfig
``model-repository`` RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload
``statistics``       ModelStatistics
``trace``            TraceSetting
``logging``          LogSettings
``control``          every RPC of ``reactant_control.ControlService`` and
                     ``reactant_control.GatewayControlService``
===================  ================================================================

Nothing is restricted by default. A group may be named by one restriction only; the key is a
lower-case header name (letters, digits, ``-``, ``_``, ``.``; not ``grpc-*``, which gRPC
reserves). The value is compared exactly, in constant time.

This module is pure (rules, parsing, the check); the servers apply it: gRPC methods are wrapped
by ``serving.restricted``, the REST apps check each routed request.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kserve_trio.core.errors import ConfigError, PermissionDenied

GROUPS: tuple[str, ...] = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
    "control",
)
"""Every group a restriction may name."""

_INFERENCE_RPC_GROUPS: Mapping[str, str] = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "IsSameIPCNamespace": "shared-memory",
    "ModelConfig": "model-config",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "ModelStatistics": "statistics",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
_CONTROL_SERVICES = ("reactant_control.ControlService", "reactant_control.GatewayControlService")

_KEY = re.compile(r"[a-z0-9_.-]+")


@dataclass(frozen=True)
class Restriction:
    """One ``group[,group...]:key=value``: the groups that need the header, and the header."""

    groups: frozenset[str]
    key: str
    value: str


def group_of(method: str) -> str | None:
    """The group of a gRPC method path (``/inference.GRPCInferenceService/ModelInfer``) or of
    a KServe RPC name (``ModelInfer``, as a REST route names it); ``None`` when it has none."""
    if method.startswith("/"):
        service, _, rpc = method[1:].partition("/")
        if service in _CONTROL_SERVICES:
            return "control"
        if service != "inference.GRPCInferenceService":
            return None
        method = rpc
    return _INFERENCE_RPC_GROUPS.get(method)


def parse_header(spec: str, path: str) -> tuple[str, str]:
    """A ``key=value`` header (``ConfigError`` naming ``path`` when malformed): the key
    lower-cased and checked like a restriction's."""
    key, eq, value = spec.partition("=")
    if not eq:
        raise ConfigError(f"must be 'key=value' (got {spec!r})", path)
    return _header(key, value, path)


def _header(key: str, value: str, path: str) -> tuple[str, str]:
    key = key.strip().lower()
    if not _KEY.fullmatch(key) or key.startswith("grpc-"):
        raise ConfigError(
            f"header key {key!r} must be lower-case letters, digits, '-', '_' or '.', and not "
            "start with 'grpc-'",
            path,
        )
    if not value or not value.isprintable() or not value.isascii():
        raise ConfigError("header value must be non-empty printable ASCII", path)
    return key, value


def parse_restriction(spec: str, path: str = "restricted_protocols") -> Restriction:
    """One ``group[,group...]:key=value`` (``ConfigError`` naming ``path`` when malformed)."""
    groups_text, sep, header = spec.partition(":")
    key, eq, value = header.partition("=")
    if not sep or not eq:
        raise ConfigError(f"must be 'group[,group...]:key=value' (got {spec!r})", path)
    groups = [g.strip().lower() for g in groups_text.split(",") if g.strip()]
    if not groups:
        raise ConfigError(f"names no group (got {spec!r})", path)
    for group in groups:
        if group not in GROUPS:
            raise ConfigError(
                f"unknown group {group!r} (groups: {', '.join(GROUPS)})",
                path,
            )
    key, value = _header(key, value, path)
    return Restriction(frozenset(groups), key, value)


def parse_restrictions(
    specs: Iterable[str], path: str = "restricted_protocols"
) -> tuple[Restriction, ...]:
    """Every restriction of a configuration; a group named twice is a ``ConfigError``."""
    out: list[Restriction] = []
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        where = f"{path}[{i}]"
        restriction = parse_restriction(spec, where)
        again = restriction.groups & seen
        if again:
            raise ConfigError(f"group {sorted(again)[0]!r} is restricted twice", where)
        seen |= restriction.groups
        out.append(restriction)
    return tuple(out)


def redacted(spec: str) -> str:
    """A restriction or header spec as a log shows it: the value after the first ``=``
    replaced (logs never hold a credential)."""
    head, eq, _ = spec.partition("=")
    return f"{head}=***" if eq else spec


class Restrictions:
    """The restrictions of one server, by group (``check`` is what a request goes through)."""

    def __init__(self, restrictions: Iterable[Restriction] = ()) -> None:
        self._by_group = {g: r for r in restrictions for g in r.groups}

    @classmethod
    def from_specs(cls, specs: Iterable[str], path: str = "restricted_protocols") -> Restrictions:
        """The restrictions a configuration lists (``parse_restrictions``)."""
        return cls(parse_restrictions(specs, path))

    @property
    def keys(self) -> frozenset[str]:
        """The header keys the restrictions read."""
        return frozenset(r.key for r in self._by_group.values())

    def __bool__(self) -> bool:
        return bool(self._by_group)

    def of(self, group: str | None) -> Restriction | None:
        """The restriction of ``group`` (``None``: that group is open)."""
        return self._by_group.get(group) if group is not None else None

    def check(self, group: str | None, headers: Mapping[str, str | bytes]) -> None:
        """Refuse PERMISSION_DENIED unless ``headers`` (lower-case names) carry the header
        ``group`` needs."""
        restriction = self.of(group)
        if restriction is None:
            return
        given = headers.get(restriction.key)
        if isinstance(given, bytes):
            given = given.decode("latin-1")
        if given is None or not hmac.compare_digest(
            given.encode("utf-8", "replace"), restriction.value.encode()
        ):
            raise PermissionDenied(
                f"the {group} protocol is restricted: this request needs header "
                f"'{restriction.key}' with the configured value"
            )


__all__ = [
    "GROUPS",
    "Restriction",
    "Restrictions",
    "group_of",
    "parse_header",
    "parse_restriction",
    "parse_restrictions",
    "redacted",
]
