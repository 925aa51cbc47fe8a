"""Checks of betterproto2 request messages: wire types, and the bounds on names and repeated
fields.

betterproto2 parses a field by its number and keeps whatever the wire type gave: a ``string``
field sent as a varint becomes an ``int``, an ``uint64`` sent length-delimited becomes bytes or a
list. Handlers written against the declared types then fail with a TypeError deep inside, which
would surface as INTERNAL. ``wrong_field`` walks a parsed message (nested messages, repeated
fields and maps included) and names the first field whose value does not have its declared
type, so the adapter answers INVALID_ARGUMENT instead. It is pure and costs a few microseconds
for the small control messages it is used on (ModelInfer has its own parser).

Bounds (``core.protocol.request_bounds``; the server's ``limits:``): every top-level string field of a
request, each string of a top-level repeated field and each key of a top-level map is a name
(model, version, region, key, parameter) and is bounded by ``max_name_bytes``; a top-level map
holds at most ``max_parameters`` entries, a repeated field at most ``max_tensors``.
betterproto2 costs microseconds per entry it decodes, so ``scan_bounds`` checks the counts and
string lengths on the wire bytes before the message is decoded (one walk over the top-level
fields that stops at the first field over its limit, and refuses a malformed wire structure:
field number 0, a group or an undefined wire type, a length past the end); ``check_bounds``
checks a decoded message (map keys included), the one rule for a message built from a REST
path and body too.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import betterproto2

from kserve_trio.core.protocol import RequestBounds, check_count, check_name, iter_fields

_INTS = {
    "int32",
    "int64",
    "uint32",
    "uint64",
    "sint32",
    "sint64",
    "fixed32",
    "fixed64",
    "sfixed32",
    "sfixed64",
}


def _scalar_ok(proto_type: str, value: Any) -> bool:
    if proto_type == "string":
        return isinstance(value, str)
    if proto_type == "bytes":
        return isinstance(value, bytes | bytearray)
    if proto_type == "bool":
        return isinstance(value, bool)
    if proto_type in _INTS:
        return isinstance(value, int) and not isinstance(value, bool)
    if proto_type in ("float", "double"):
        return isinstance(value, float)
    if proto_type == "enum":
        return isinstance(value, enum.Enum | int) and not isinstance(value, bool)
    if proto_type == "message":
        return value is None or isinstance(value, betterproto2.Message)
    return True


def _check_value(meta: Any, value: Any, path: str) -> str | None:
    if meta.proto_type == "message" and isinstance(value, betterproto2.Message):
        return wrong_field(value, path)
    if not _scalar_ok(meta.proto_type, value):
        return path
    return None


def wrong_field(message: betterproto2.Message, prefix: str = "") -> str | None:
    """The dotted path of the first field whose value does not have its declared type, or
    ``None`` when every field (recursively) is well typed."""
    for f in dataclasses.fields(message):  # type: ignore[arg-type]
        meta = f.metadata.get("betterproto")
        if meta is None:
            continue
        value = getattr(message, f.name)
        path = f"{prefix}{f.name}"
        if meta.proto_type == "map":
            if not isinstance(value, dict):
                return path
            key_meta, value_meta = meta.map_meta
            for k, v in value.items():
                if not _scalar_ok(key_meta.proto_type, k):
                    return path
                bad = _check_value(value_meta, v, f"{path}[{k!r}].")
                if bad is not None:
                    return bad.rstrip(".")
        elif meta.repeated:
            if not isinstance(value, list):
                return path
            for i, item in enumerate(value):
                bad = _check_value(meta, item, f"{path}[{i}].")
                if bad is not None:
                    return bad.rstrip(".")
        elif value is not None or not meta.optional:
            bad = _check_value(meta, value, f"{path}.")
            if bad is not None:
                return bad.rstrip(".")
    return None


def _layout(message_type: type) -> dict[int, tuple[str, Any]]:
    """Field number -> (field name, betterproto2 metadata) of a message class, cached."""
    layout = _LAYOUTS.get(message_type)
    if layout is None:
        layout = {}
        for f in dataclasses.fields(message_type):  # type: ignore[arg-type]
            meta = f.metadata.get("betterproto")
            if meta is not None:
                layout[meta.number] = (f.name, meta)
        _LAYOUTS[message_type] = layout
    return layout


_LAYOUTS: dict[type, dict[int, tuple[str, Any]]] = {}


def _count_limit(meta: Any, bounds: RequestBounds) -> tuple[int, str]:
    if meta.proto_type == "map":
        return bounds.max_parameters, "max_parameters"
    return bounds.max_tensors, "max_tensors"


def scan_bounds(
    data: bytes | bytearray | memoryview, message_type: type, bounds: RequestBounds
) -> None:
    """Before ``message_type`` is decoded from ``data``: the counts and name lengths of its
    top-level fields (module docstring). ``InvalidArgument`` over a bound; ``ValueError`` when
    the wire structure is malformed."""
    layout = _layout(message_type)
    buf = memoryview(data).cast("B")
    max_name = bounds.max_name_bytes
    counts: dict[int, int] = {}
    try:
        for field, wt, value in iter_fields(buf, 0, len(buf)):
            entry = layout.get(field)
            if entry is None:
                continue
            name, meta = entry
            if meta.repeated or meta.proto_type == "map":
                count = counts[field] = counts.get(field, 0) + 1
                limit, key = _count_limit(meta, bounds)
                if limit and count > limit:
                    check_count(name, count, limit, key)
            if meta.proto_type == "string" and wt == 2 and max_name:
                start, end = value  # type: ignore[misc]
                if end - start > max_name:
                    text = bytes(buf[start:end]).decode("utf-8", "replace")
                    check_name(name, text, max_name)
    except IndexError:
        raise ValueError("truncated message") from None


def check_bounds(message: betterproto2.Message, bounds: RequestBounds) -> None:
    """The bounds of a decoded request message (module docstring)."""
    max_name = bounds.max_name_bytes
    for name, meta in _layout(type(message)).values():
        value = getattr(message, name, None)
        if meta.proto_type == "map" and isinstance(value, dict):
            limit, key = _count_limit(meta, bounds)
            check_count(name, len(value), limit, key)
            for k in value:
                if isinstance(k, str):
                    check_name(f"{name} key", k, max_name)
        elif meta.repeated and isinstance(value, list):
            limit, key = _count_limit(meta, bounds)
            check_count(name, len(value), limit, key)
            if meta.proto_type == "string":
                for item in value:
                    if isinstance(item, str):
                        check_name(name, item, max_name)
        elif meta.proto_type == "string" and isinstance(value, str):
            check_name(name, value, max_name)


__all__ = ["check_bounds", "scan_bounds", "wrong_field"]
