"""How deeply a JSON text nests, found without parsing it (pure).

Python's ``json`` parser recurses once per nesting level: a body of 5,000 ``[`` costs thousands
of stack frames and ends in ``RecursionError`` (an internal error, not the client's fault)
before any rule of ours runs. ``check_json_depth`` answers the question first and cheaply, so
the parser only ever sees texts it can parse:

1. A text with at most ``limit`` openers (``[`` and ``{``) in all cannot nest deeper: two
   ``bytes.count`` calls and nothing else, which is every ordinary request.
2. Otherwise one regular-expression pass drops the strings (so a bracket inside a string does
   not count) and everything that is not a bracket or a brace; what is left is the text's
   nesting skeleton, usually far smaller than the text. Its running depth is summed with
   numpy a block at a time, so the cost is linear and the memory a few bytes per bracket.

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


def _skeleton_depth(skeleton: Text) -> int:
    steps = _STEP[np.frombuffer(skeleton, dtype=np.uint8)]
    depth = deepest = 0
    for start in range(0, len(steps), _BLOCK):
        running = np.cumsum(steps[start : start + _BLOCK], dtype=np.int64)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
    return deepest


def nesting_depth(text: Text, end: int | None = None) -> int:
    """The deepest nesting of arrays and objects in ``text[:end]`` (strings skipped)."""
    end = len(text) if end is None else end
    part = text if end == len(text) else text[:end]
    return _skeleton_depth(_NOT_NESTING.sub(b"", part))


def check_json_depth(text: Text, limit: int, what: str, end: int | None = None) -> None:
    """Raise ``JsonTooDeep`` when ``text[:end]`` nests deeper than ``limit`` (0: no limit)."""
    if limit <= 0:
        return
    end = len(text) if end is None else end
    if text.count(b"[", 0, end) + text.count(b"{", 0, end) <= limit:
        return
    depth = nesting_depth(text, end)
    if depth > limit:
        raise JsonTooDeep(
            f"{what} nests {depth} levels deep, more than the limit of {limit} "
            "(limits.max_json_depth)"
        )


__all__ = ["JsonTooDeep", "check_json_depth", "nesting_depth"]
