"""Type check of parsed betterproto2 messages: a field sent with the wrong wire type is refused.

betterproto2 parses a field by its number and keeps whatever the wire type gave: a ``string``
field sent as a varint becomes an ``int``, an ``uint64`` sent length-delimited becomes bytes or a
list. Handlers written against the declared types then fail with a TypeError deep inside, which
would surface as INTERNAL. ``wrong_field`` walks a parsed message (nested messages, repeated
fields and maps included) and names the first field whose value does not have its declared
type, so the adapter answers INVALID_ARGUMENT instead. It is pure and costs a few microseconds
for the small control messages it is used on (ModelInfer has its own parser).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import betterproto2

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


__all__ = ["wrong_field"]
