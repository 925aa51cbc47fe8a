"""Numeric JSON tensor ``data`` taken out of a REST body and decoded straight into numpy (pure).

``json.loads`` makes a Python object per number (a float is 24 bytes plus its 8-byte list slot),
so a list of short numbers costs many times its text, all of it before any rule can compare
the element count with the declared shape. This module keeps the numbers out of the parse:

1. *Lifting*: ``lift_number_arrays`` finds every ``"data"`` key whose value is an array of numbers
   only (any nesting) and copies the JSON text with each such array replaced by a placeholder
   string; the arrays stay where they are, as ``NumberArray`` spans of the original text. The copy
   costs the text minus the arrays. A ``"data"`` key is recognised by its unescaped opening quote:
   in valid JSON such a quote opens a string, so ``"data":`` is a key. The placeholders are strings
   that start with U+0000, which a client can only spell as ``\\u0000``; a body that contains that
   escape anywhere has nothing lifted and is parsed whole, so a client's string is never taken for a
   placeholder.
2. *Counting*: ``NumberArray.count`` is the element count, from the commas and the empty arrays of
   the span (C-speed ``bytes.count``): the caller compares it with the declared shape before
   anything is decoded or allocated.
3. *Decoding*: ``NumberArray.decode`` parses the span about 1 MiB of text at a time, as JSON (the
   grammar is JSON's exactly: each piece is the span's text, re-bracketed to stand alone), and
   writes each piece's numbers into one preallocated array of the declared dtype. What it holds at
   once is that array and one piece's Python numbers.

The structure is checked as the pieces parse: a value next to a list ("mixes lists and values"),
a value out of the dtype's range, an array that closes before its end. Arrays of booleans only
are lifted the same way (a BOOL tensor: one byte per element); strings and ``null`` are never
lifted: those arrays go through ``json.loads`` as before.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kserve_trio.core.errors import InvalidArgument

Text = bytes | bytearray

_DATA_KEY = re.compile(rb'"data"\s*:\s*\[')
_NUMBER_RUN = re.compile(rb"[-+0-9.eE,\s\[\]]*")
"""The characters a nested array of JSON numbers is made of (a superset: JSON checks the rest)."""
_BOOLEAN_RUN = re.compile(rb"[truefals,\s\[\]]*")
"""The same for an array of JSON booleans."""
_FIRST_NUMBER = re.compile(rb"[-0-9]")
_FIRST_BOOLEAN = re.compile(rb"[tf]")
_FRACTION = re.compile(rb"[.eE]")
_BLANK_EMPTY = re.compile(rb"\[\s+\]")
_NUL_ESCAPE = b"\\u0000"
_PIECE_BYTES = 1 << 20
_WS = b" \t\r\n"
_PLACEHOLDER = "\x00"


class MalformedNumbers(InvalidArgument):
    """A lifted array is not what JSON (or the tensor) allows: ``message`` says what."""


@dataclass(frozen=True)
class NumberArray:
    """One lifted ``data`` array: ``text[start:end]``, a JSON array of numbers only (or of
    booleans only, ``booleans``)."""

    text: Text
    start: int
    end: int
    leaf_depth: int
    """How many ``[`` enclose a value (1 for a flat list; 0 when it holds no value)."""
    booleans: bool = False

    def count(self) -> int:
        """The number of numbers in the array (exact for valid JSON; commas separate the
        leaves of a nested array and its sub-arrays, so leaves = commas - empty arrays + 1)."""
        if self.leaf_depth == 0:
            return 0
        t, a, e = self.text, self.start, self.end
        empty = t.count(b"[]", a, e)
        if _BLANK_EMPTY.search(t, a, e) is not None:
            empty += sum(1 for _ in _BLANK_EMPTY.finditer(t, a, e))
        return t.count(b",", a, e) - empty + 1

    def has_fraction(self) -> bool:
        """Whether some number has a fraction or an exponent (JSON's non-integers)."""
        return _FRACTION.search(self.text, self.start, self.end) is not None

    def decode(self, dtype: np.dtype, count: int, what: str, out_of_range: str) -> np.ndarray:
        """The ``count`` numbers as a flat array of ``dtype`` (module docstring, *decoding*);
        ``MalformedNumbers`` naming ``what`` when the span does not fit, with the message
        ``out_of_range`` when a value does not fit the dtype."""
        out = np.empty(count, dtype=dtype)
        if self.leaf_depth == 0:  # only (nested) empty arrays: nothing to parse
            return out
        t, pos, end = self.text, self.start, self.end
        depth = filled = 0
        while pos < end:
            cut = t.find(b",", pos + _PIECE_BYTES, end) if end - pos > _PIECE_BYTES else -1
            if cut == -1:
                cut = end
            else:
                _check_split(t, cut, what)
            piece = t[pos:cut]
            after = depth + piece.count(b"[") - piece.count(b"]")
            if after < 0 or (after == 0 and cut != end):
                raise MalformedNumbers(f"malformed JSON in {what} 'data': the array ends early")
            try:
                doc = json.loads(b"[" * depth + piece + b"]" * after)
            except (ValueError, RecursionError) as exc:
                raise MalformedNumbers(f"malformed JSON in {what} 'data': {exc}") from None
            values = _leaves(doc, self.leaf_depth, what)
            if filled + len(values) > count:
                raise MalformedNumbers(f"malformed JSON in {what} 'data'")
            try:
                out[filled : filled + len(values)] = values
            except OverflowError:
                raise MalformedNumbers(out_of_range) from None
            except (ValueError, TypeError):
                raise MalformedNumbers(f"{what} 'data' mixes lists and values") from None
            filled += len(values)
            depth = after
            pos = cut + 1
        if filled != count:
            raise MalformedNumbers(f"malformed JSON in {what} 'data'")
        return out


def _check_split(t: Text, cut: int, what: str) -> None:
    """A comma where the text is split must sit between two values (a piece that begins or
    ends at a bracket would otherwise hide ``[,`` or ``,]`` from the parser)."""
    before = cut - 1
    while before >= 0 and t[before] in _WS:
        before -= 1
    after = cut + 1
    while after < len(t) and t[after] in _WS:
        after += 1
    if before < 0 or after >= len(t) or t[before] in b"[," or t[after] in b"],":
        raise MalformedNumbers(f"malformed JSON in {what} 'data'")


def _leaves(doc: Any, leaf_depth: int, what: str) -> list[Any]:
    values = doc
    try:
        for _ in range(leaf_depth - 1):
            values = list(itertools.chain.from_iterable(values))
    except TypeError:
        raise MalformedNumbers(f"{what} 'data' mixes lists and values") from None
    return values


@dataclass
class LiftedJson:
    """The JSON text to parse (``text``: the original or a copy with placeholders) and the
    arrays its placeholders stand for."""

    text: Text
    arrays: list[NumberArray]

    def array_of(self, value: Any) -> NumberArray | None:
        """The lifted array a parsed value stands for (``None``: not a placeholder)."""
        if not self.arrays or value.__class__ is not str or not value.startswith(_PLACEHOLDER):
            return None
        index = value[1:]
        if not index.isdigit() or int(index) >= len(self.arrays):
            return None
        return self.arrays[int(index)]

    def is_placeholder(self, value: Any) -> bool:
        return self.array_of(value) is not None


def _escaped(t: Text, quote: int) -> bool:
    slashes = 0
    while quote - slashes - 1 >= 0 and t[quote - slashes - 1] == 0x5C:
        slashes += 1
    return slashes % 2 == 1


def _span_end(t: Text, start: int, end: int, run_of: re.Pattern[bytes]) -> int | None:
    """Where the array starting at ``t[start] == '['`` ends, or ``None`` when what follows the
    bracket is not an array of only the characters ``run_of`` allows."""
    run = run_of.match(t, start, end)
    stop = run.end() if run is not None else start
    while stop > start and t[stop - 1] in b" \t\r\n,":
        stop -= 1
    if stop <= start or t[stop - 1] != 0x5D:  # ']'
        return None
    if t.count(b"[", start, stop) != t.count(b"]", start, stop):
        return None
    return stop


def lift_number_arrays(text: Text, end: int | None = None) -> LiftedJson:
    """``text[:end]`` with its numeric ``data`` arrays replaced by placeholders (module
    docstring, *lifting*)."""
    end = len(text) if end is None else end
    whole = text if end == len(text) else bytes(text[:end])
    if text.find(_NUL_ESCAPE, 0, end) != -1 or text.find(b'"data"', 0, end) == -1:
        return LiftedJson(whole, [])
    arrays: list[NumberArray] = []
    pieces: list[Text | bytes] = []
    kept = 0
    pos = 0
    while True:
        found = _DATA_KEY.search(text, pos, end)
        if found is None:
            break
        start = found.end() - 1
        pos = start + 1
        if _escaped(text, found.start()):
            continue
        booleans = False
        stop = _span_end(text, start, end, _NUMBER_RUN)
        if stop is None:
            booleans = True
            stop = _span_end(text, start, end, _BOOLEAN_RUN)
        if stop is None:
            continue
        first = (_FIRST_BOOLEAN if booleans else _FIRST_NUMBER).search(text, start, stop)
        leaf_depth = 0
        if first is not None:
            at = first.start()
            leaf_depth = max(text.count(b"[", start, at) - text.count(b"]", start, at), 1)
        pieces.append(text[kept:start])
        pieces.append(b'"\\u0000%d"' % len(arrays))
        arrays.append(NumberArray(text, start, stop, leaf_depth, booleans))
        kept = pos = stop
    if not arrays:
        return LiftedJson(whole, [])
    pieces.append(text[kept:end])
    return LiftedJson(b"".join(pieces), arrays)


__all__ = ["LiftedJson", "MalformedNumbers", "NumberArray", "lift_number_arrays"]
