"""``FrozenMap``: the read-only mapping a frozen configuration holds (per-model blocks, the
tracing resource attributes), in a module of its own so every block's module can use it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

V = TypeVar("V")


class FrozenMap(Mapping[str, V]):
    """A read-only, hashable mapping, so a frozen config holding per-model blocks stays frozen."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = ()) -> None:
        self._items: dict[str, V] = dict(items)

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


__all__ = ["FrozenMap"]
