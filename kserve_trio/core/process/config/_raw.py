"""Helpers on raw configuration dicts (the YAML shape), shared by the worker, node and gateway
configurations: reading a YAML mapping from a file, deep-merging layers, setting a dotted path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from kserve_trio.core.errors import ConfigError


def join_path(prefix: str, key: str) -> str:
    """``prefix.key``, or ``key`` at the root: how every config error names a YAML path."""
    return f"{prefix}.{key}" if prefix else key


def load_yaml_mapping(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Read a YAML file whose root must be a mapping; ``what`` names it in errors
    (``"node config"``: "node config file not found: ...")."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file not found: {p}")
    try:
        raw = YAML(typ="safe").load(p.read_text())
    except (YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {p} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} root must be a mapping (file {p})")
    return raw


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``over`` merged into ``base``; mappings merge recursively, the rest replace.

    Neither argument is modified and no nested mapping of either is shared with the result.
    """
    out: dict[str, Any] = {}
    for key, value in base.items():
        out[key] = deep_merge({}, value) if isinstance(value, Mapping) else _copy(value)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = deep_merge({}, value) if isinstance(value, Mapping) else _copy(value)
    return out


def merge_given(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides`` merged over it, leaving out their ``None`` leaves: the
    command-line flags that were not given (so they do not erase a file's or the environment's
    value)."""
    return deep_merge(raw, _given(overrides))


def _given(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out[key] = _given(value)
        elif value is not None:
            out[key] = value
    return out


def _copy(value: Any) -> Any:
    return [_copy(v) for v in value] if isinstance(value, list) else value


def set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    """Set the dotted ``path`` in ``raw`` in place, creating missing blocks; a block that is a
    read-only mapping is copied into a dict first, a non-mapping on the way is a ConfigError."""
    *parents, leaf = path.split(".")
    cur = raw
    walked = ""
    for key in parents:
        walked = join_path(walked, key)
        nxt = cur.get(key)
        if nxt is None:
            nxt = cur[key] = {}
        elif not isinstance(nxt, dict):
            if not isinstance(nxt, Mapping):
                raise ConfigError(f"config '{walked}' must be a mapping", walked)
            nxt = cur[key] = dict(nxt)
        cur = nxt
    cur[leaf] = value
