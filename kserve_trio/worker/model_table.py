"""The worker's live model table: which ``ModelState`` serves each model name right now.

One table per scheduler. The model admin (``Scheduler.add_model`` and its siblings) is its only
writer; the request path looks models up in it, and the dispatch loop reads it to find the
models with queued work and to answer every queue at shutdown. Everything that touches it runs
on the event loop thread, so nothing is locked.
"""

from __future__ import annotations

from collections.abc import Iterator

from kserve_trio.core.errors import NotFound, Unavailable
from kserve_trio.worker.model_state import ModelState, same_io


class ModelTable:
    """Model name -> the ``ModelState`` serving it. A reload puts a new state under the same
    name and links the old one to it (``ModelState.replaced_by``), so a request prepared
    against the old state finds where it goes (``current``)."""

    __slots__ = ("_by_name",)

    def __init__(self) -> None:
        self._by_name: dict[str, ModelState] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> ModelState:
        return self._by_name[name]

    def get(self, name: str) -> ModelState | None:
        return self._by_name.get(name)

    def require(self, name: str) -> ModelState:
        """The state serving ``name``; NOT_FOUND ``unknown model: name`` when none does."""
        state = self._by_name.get(name)
        if state is None:
            raise NotFound(f"unknown model: {name}")
        return state

    def names(self) -> list[str]:
        """The loaded model names, sorted."""
        return sorted(self._by_name)

    def states(self) -> Iterator[ModelState]:
        """Every loaded model's state, in load order."""
        return iter(self._by_name.values())

    def by_name(self) -> list[tuple[str, ModelState]]:
        """(name, state) of every loaded model, sorted by name."""
        return sorted(self._by_name.items())

    def snapshot(self) -> dict[str, ModelState]:
        """A copy of the table, for work that runs while the table may change."""
        return dict(self._by_name)

    def ready(self) -> list[ModelState]:
        """The models with at least one queued request, in load order."""
        return [s for s in self._by_name.values() if s.queue]

    def current(self, name: str, state: ModelState) -> ModelState:
        """The live state for a request prepared against ``state`` (which may have been swapped).

        A reload with an unchanged I/O spec hands the request to the new version; any other
        reload answers UNAVAILABLE (retry); an unload answers NOT_FOUND.
        """
        live = self._by_name.get(name)
        if live is state:
            return state
        nxt = state.replaced_by
        while nxt is not None and nxt is not live:
            nxt = nxt.replaced_by
        if live is not None and nxt is live:
            if same_io(state, live):
                return live
            raise Unavailable(f"model '{name}' was reloaded; retry")
        raise NotFound(f"model '{name}' was unloaded")

    def put(self, state: ModelState) -> None:
        """Serve ``state.name`` with ``state`` (a new model, a new version, a renamed one)."""
        self._by_name[state.name] = state

    def pop(self, name: str) -> ModelState | None:
        """Take ``name`` out of the table; its state, or None when it was not loaded."""
        return self._by_name.pop(name, None)

    def discard(self, name: str, state: ModelState) -> None:
        """Take ``name`` out if ``state`` still serves it (an admission that failed)."""
        if self._by_name.get(name) is state:
            del self._by_name[name]


__all__ = ["ModelTable"]
