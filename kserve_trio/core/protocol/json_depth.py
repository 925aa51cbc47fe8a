"""How deeply a JSON text nests, found without parsing it (pure).

Python's ``json`` parser recurses once per nesting level: a body of 5,000 ``[`` costs thousands
of stack frames and ends in ``RecursionError`` (an internal error, not the client's fault)
before any rule of ours runs. ``check_json_depth`` answers the question first and cheaply, so
the parser only ever sees texts it can parse:

1. A text with at most ``limit`` openers (``[`` and ``{``) in all cannot nest deeper: two
   ``bytes.count`` calls and nothing else, which is every ordinary request.
2. Otherwise one regular-expression pass drops the strings (so a bracket inside a string does
   not count) and everything that is not a bracket or a brace; what is left is the text's
   nesting skeleton, usually far smaller than the text and never larger. Its running depth is
   summed with numpy a block at a time (a few MiB of temporaries), stopping at the first block
   that passes the limit.

An unterminated string leaves its quote in the skeleton and its brackets counted: such a text
is not JSON anyway, and refusing it as too deep is as correct as refusing it as malformed.
"""

from __future__ import annotations

import re

import numpy as np

from kserve_trio.core.errors import InvalidArgument

Text = bytes | bytearray

_NOT_NESTING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[^\[\]{}"]+')
"""A JSON string, or a run of characters that are neither brackets, braces nor quotes."""

_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1

_BLOCK = 1 << 20
"""Skeleton characters summed per numpy step (bounds the temporary to a few MiB)."""


class JsonTooDeep(InvalidArgument):
    """A JSON body nests deeper than ``limits.max_json_depth`` (HTTP 400)."""


def _skeleton_depth(skeleton: Text, stop_above: int | None) -> int:
    """The deepest running depth of a skeleton, a block at a time (the first depth past
    ``stop_above`` when one is given: the rest need not be read)."""
    chars = np.frombuffer(skeleton, dtype=np.uint8)
    depth = deepest = 0
    for start in range(0, len(chars), _BLOCK):
        running = np.cumsum(_STEP[chars[start : start + _BLOCK]], dtype=np.int64)
        deepest = max(deepest, depth + int(running.max()))
        if stop_above is not None and deepest > stop_above:
            break
        depth += int(running[-1])
    return deepest


def nesting_depth(text: Text, end: int | None = None, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in ``text[:end]`` (strings skipped); with
    ``stop_above``, the scan may stop at the first depth past it and answer that."""
    end = len(text) if end is None else end
    part = text if end == len(text) else text[:end]
    return _skeleton_depth(_NOT_NESTING.sub(b"", part), stop_above)


def check_json_depth(text: Text, limit: int, what: str, end: int | None = None) -> None:
    """Raise ``JsonTooDeep`` when ``text[:end]`` nests deeper than ``limit`` (0: no limit)."""
    if limit <= 0:
        return
    end = len(text) if end is None else end
    if text.count(b"[", 0, end) + text.count(b"{", 0, end) <= limit:
        return
    depth = nesting_depth(text, end, stop_above=limit)
    if depth > limit:
        raise JsonTooDeep(
            f"{what} nests at least {depth} levels deep, more than the limit of {limit} "
            "(limits.max_json_depth)"
        )


__all__ = ["JsonTooDeep", "check_json_depth", "nesting_depth"]
