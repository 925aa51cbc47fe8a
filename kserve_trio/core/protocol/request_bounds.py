"""The cost of refusing a message: names and repeated fields are bounded before per-entry work.

A request may carry names (model, version, input, output, parameter keys, shared-memory
regions) and repeated fields (inputs, requested outputs, raw contents, parameters) of any size
its message cap allows. Left unbounded, refusing one costs the server memory and time in
proportion to what it holds per entry, not to the bytes it received, and every message that
echoes a name costs as much again. The ``limits:`` block (``core.process.config.EdgeLimits``) bounds
them; this module owns the rules and their messages, for every transport and both servers:

- ``check_name``: a name longer than ``limits.max_name_bytes`` (UTF-8) is INVALID_ARGUMENT;
- ``check_count``: a repeated field with more entries than its limit is INVALID_ARGUMENT;
- ``shown``: how a client-given name appears in any message or log: quoted when short, else a
  bounded prefix and its length, so no name is ever copied whole into a reply;
- ``check_path_names``: the names of a REST path, as soon as it is routed;
- ``check_infer_request``: every bound of a parsed ModelInfer request, then
  ``raw_input_contents`` holding no more entries than there are inputs;
- ``require_model_name``: a request that must name a model names one (one message whoever
  checks it);
- ``check_model_name``: a model name a repository RPC acts on has no path separator, NUL or
  ``.``/``..`` (INVALID_ARGUMENT, the same on a worker and through a gateway).

A limit of 0 turns that bound off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kserve_trio.core.errors import InvalidArgument

SHOWN_CHARS = 64
"""A name longer than this appears in messages as a prefix of this many characters."""


class RequestBounds(Protocol):
    """The three limits these rules read (``EdgeLimits`` has them)."""

    @property
    def max_name_bytes(self) -> int: ...

    @property
    def max_tensors(self) -> int: ...

    @property
    def max_parameters(self) -> int: ...


def shown(name: str) -> str:
    """``name`` quoted for a message: whole when short, else a prefix and the name's length."""
    if len(name) <= SHOWN_CHARS:
        return f"'{name}'"
    return f"'{name[:SHOWN_CHARS]}...' ({len(name)} characters)"


def name_too_long(name: str, max_bytes: int) -> int:
    """The UTF-8 length of ``name`` when it is over ``max_bytes`` (0 = no limit), else 0.
    A name of at most a quarter as many characters is under it whatever its encoding: only
    longer names are encoded to be measured."""
    if not max_bytes or len(name) * 4 <= max_bytes:
        return 0
    size = len(name.encode("utf-8", "surrogatepass"))
    return size if size > max_bytes else 0


def check_name(what: str, name: str, max_bytes: int) -> None:
    """Refuse a name longer than ``max_bytes`` UTF-8 bytes: ``what`` says which name it is."""
    size = name_too_long(name, max_bytes)
    if size:
        raise InvalidArgument(
            f"{what} is {size} bytes, over the limit of {max_bytes} (limits.max_name_bytes): "
            f"{shown(name)}"
        )


def check_count(what: str, count: int, limit: int, key: str) -> None:
    """Refuse ``count`` entries of a repeated field over ``limit`` (``limits.<key>``)."""
    if limit and count > limit:
        raise InvalidArgument(
            f"{what} has more than {limit} entries (limits.{key})"
            if count == limit + 1
            else f"{what} has {count} entries, over the limit of {limit} (limits.{key})"
        )


def check_parameters(what: str, parameters: Mapping[str, Any], bounds: RequestBounds) -> None:
    """A parameter map: its entry count, then each key (``what`` names its owner)."""
    limit = bounds.max_parameters
    if limit and len(parameters) > limit:
        check_count(f"{what} parameters", len(parameters), limit, "max_parameters")
    max_bytes = bounds.max_name_bytes
    for key in parameters:
        if name_too_long(key, max_bytes):
            check_name(f"{what} parameter key", key, max_bytes)


def check_names(what: str, names: Iterable[str], max_bytes: int) -> None:
    """Each of ``names`` (``what`` names their kind)."""
    for name in names:
        check_name(what, name, max_bytes)


def check_infer_request(msg: Any, bounds: RequestBounds) -> None:
    """Every bound of a parsed ModelInfer request (``core.protocol.infer_wire.InferRequestMessage`` or
    anything with its fields), before any per-tensor work: the model name and version, the
    request's parameters, the inputs and requested outputs (count, names, parameters), and at
    most one ``raw_input_contents`` entry per input."""
    limit = bounds.max_name_bytes
    check_name("model_name", msg.model_name, limit)
    check_name("model_version", msg.model_version, limit)
    if msg.parameters:
        check_parameters("request", msg.parameters, bounds)
    check_count("inputs", len(msg.inputs), bounds.max_tensors, "max_tensors")
    check_count("outputs", len(msg.outputs), bounds.max_tensors, "max_tensors")
    for tensor in msg.inputs:
        check_name("input name", tensor.name, limit)
        if tensor.parameters:  # the owner's name is only spelled out for a message
            check_parameters(f"input {shown(tensor.name)}", tensor.parameters, bounds)
    for out in msg.outputs:
        check_name("output name", out.name, limit)
        if out.parameters:
            check_parameters(f"output {shown(out.name)}", out.parameters, bounds)
    raw = len(msg.raw_input_contents)
    if raw > len(msg.inputs):
        raise InvalidArgument(
            f"request has {raw} raw_input_contents entries but only {len(msg.inputs)} input(s)"
        )


def check_path_names(model: str, version: str, region: str, max_bytes: int) -> None:
    """The names a REST path carries (``/v2/models/{m}/versions/{v}``,
    ``/v2/systemsharedmemory/region/{r}``), checked as soon as the path is routed."""
    check_name("model_name", model, max_bytes)
    check_name("model_version", version, max_bytes)
    check_name("region name", region, max_bytes)


def require_model_name(name: str) -> None:
    """The one rule for a request that must name a model and names none, whoever meets it
    first (the worker's lookup, the ModelInfer decode, the gateway's routing peek)."""
    if not name:
        raise InvalidArgument("model_name is empty")


def check_model_name(rpc: str, name: str) -> None:
    """A model name a repository RPC acts on: non-empty, no ``/``, ``\\`` or NUL, and not
    ``.`` or ``..`` (a model is a directory of the repository, never a path out of it)."""
    if not name:
        raise InvalidArgument(f"{rpc} needs a model_name")
    if name in (".", "..") or any(c in name for c in "/\\\x00"):
        raise InvalidArgument(
            f"{rpc}: {shown(name)} is not a model name (no path separators, NUL, '.' or '..')"
        )


__all__ = [
    "SHOWN_CHARS",
    "RequestBounds",
    "check_count",
    "check_infer_request",
    "check_model_name",
    "check_name",
    "check_names",
    "check_parameters",
    "check_path_names",
    "name_too_long",
    "require_model_name",
    "shown",
]
