"""Merging Prometheus text expositions (format 0.0.4): the gateway's ``/metrics`` serves its own
series and its workers' as one exposition, so one scrape target covers the fleet.

Pure text in, text out. A sample belongs to a family by name: the family itself, or the family
plus a suffix its type allows (a histogram's ``_bucket``, ``_sum``, ``_count``; a summary's
``_sum``, ``_count``; a counter's ``_total``; ...). ``add_worker_label`` gives a worker's samples
a ``worker`` label when they lack one, so workers that did not label themselves do not collide.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
}
_ALL_SUFFIXES = tuple(sorted({s for group in _SUFFIXES.values() for s in group}, key=len))


class ExpositionError(ValueError):
    """A sample line that cannot be split into name, labels and value."""


def split_sample(line: str) -> tuple[str, str, str]:
    """``(name, label block incl. braces or "", the rest: value [timestamp])`` of a sample
    line; label values may contain ``}``, spaces and escaped quotes."""
    i = 0
    n = len(line)
    while i < n and line[i] not in "{ \t":
        i += 1
    name = line[:i]
    if not name:
        raise ExpositionError(f"sample line without a metric name: {line!r}")
    if i < n and line[i] == "{":
        start = i
        i += 1
        quoted = False
        while i < n:
            c = line[i]
            if quoted:
                if c == "\\":
                    i += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "}":
                break
            i += 1
        if i >= n:
            raise ExpositionError(f"unterminated label set: {line!r}")
        labels = line[start : i + 1]
        i += 1
    else:
        labels = ""
    rest = line[i:].strip()
    if not rest:
        raise ExpositionError(f"sample line without a value: {line!r}")
    return name, labels, rest


def label_names(block: str) -> list[str]:
    """The label names of a label block (``{a="1",b="x,y"}`` -> ``["a", "b"]``)."""
    names = []
    i, n = 1, len(block) - 1
    while i < n:
        while i < n and block[i] in " ,\t":
            i += 1
        start = i
        while i < n and block[i] not in "= \t":
            i += 1
        if i > start:
            names.append(block[start:i])
        while i < n and block[i] != '"':
            i += 1
        i += 1
        while i < n and block[i] != '"':
            i += 2 if block[i] == "\\" else 1
        i += 1
    return names


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)
    series: set[tuple[str, str]] = field(default_factory=set)


def _allows(family: str, kind: str | None, sample: str) -> bool:
    if sample == family:
        return True
    return any(sample == family + s for s in _SUFFIXES.get(kind or "", ()))


def merge_expositions(texts: Iterable[str]) -> str:
    """One exposition holding every family and sample of ``texts`` (in order).

    Rules:
    1. Families appear in the order first seen; each gets one ``# HELP`` and one ``# TYPE``
       line, the first seen of each (a later source's differing ones are dropped).
    2. A sample joins the family it belongs to in its own source: the family being declared
       when it appears, if its name matches that family (exactly or with a suffix the family's
       type allows), else the source's family it matches by suffix, else a family of its own
       name (untyped). So a histogram's ``_bucket``, ``_sum`` and ``_count`` stay together.
    3. A sample of a family whose type in its own source differs from the merged family's
       type is dropped (it would make the output invalid); so is a repeated series (same name
       and label block): first seen wins.
    4. Other comment lines and blank lines are dropped; lines that are not samples raise
       ``ExpositionError``.
    """
    families: dict[str, _Family] = {}
    for text in texts:
        local_types: dict[str, str | None] = {}
        current: str | None = None
        for raw_line in text.splitlines():
            line = raw_line.strip()
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    name = parts[2]
                    rest = parts[3] if len(parts) > 3 else ""
                    fam = families.setdefault(name, _Family())
                    if parts[1] == "HELP":
                        fam.help = rest if fam.help is None else fam.help
                        local_types.setdefault(name, None)
                    else:
                        kind = rest.strip().lower()
                        fam.type = kind if fam.type is None else fam.type
                        local_types[name] = kind
                    current = name
                continue
            name, labels, _value = split_sample(line)
            owner = _owner(name, current, local_types)
            fam = families.setdefault(owner, _Family())
            if local_types.get(owner) not in (None, fam.type) and fam.type is not None:
                continue
            key = (name, labels)
            if key in fam.series:
                continue
            fam.series.add(key)
            fam.samples.append(line)
    out: list[str] = []
    for name, fam in families.items():
        if fam.help is not None:
            out.append(f"# HELP {name} {fam.help}" if fam.help else f"# HELP {name}")
        if fam.type is not None:
            out.append(f"# TYPE {name} {fam.type}")
        out.extend(fam.samples)
    return "\n".join(out) + "\n" if out else ""


def _owner(sample: str, current: str | None, local_types: dict[str, str | None]) -> str:
    if current is not None and _allows(current, local_types.get(current), sample):
        return current
    for suffix in _ALL_SUFFIXES:
        if sample.endswith(suffix):
            base = sample[: -len(suffix)]
            if base in local_types and _allows(base, local_types[base], sample):
                return base
    return sample


def add_label(text: str, label: str, value: str) -> str:
    """``text`` with ``label="<value>"`` added to every sample that has no ``label`` label
    (comments untouched)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    out = []
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("#"):
            out.append(raw_line)
            continue
        name, labels, rest = split_sample(line)
        if labels and label in label_names(labels):
            out.append(line)
            continue
        inner = labels[1:-1].strip().rstrip(",") if labels else ""
        joined = f'{inner},{label}="{escaped}"' if inner else f'{label}="{escaped}"'
        out.append(f"{name}{{{joined}}} {rest}")
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def add_worker_label(text: str, worker: str) -> str:
    """``text`` with ``worker="<worker>"`` added to every sample that has no ``worker`` label
    (comments untouched)."""
    return add_label(text, "worker", worker)


__all__ = [
    "ExpositionError",
    "add_label",
    "add_worker_label",
    "label_names",
    "merge_expositions",
    "split_sample",
]
