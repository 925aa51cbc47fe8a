"""Predicates on plain values read from YAML or JSON (configuration, node files, manifests):
one owner for the rules every reader of those documents applies."""

from __future__ import annotations

from typing import TypeGuard


def is_int(v: object) -> TypeGuard[int]:
    """An integer and not a bool (YAML and JSON booleans are ``int`` subclasses in Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


__all__ = ["is_int"]
