"""The model-repository watcher: what changed on disk, and when a change is safe to apply.

This module owns dynamic mode's change detection. It is
split the h2 way:

* pure logic, no I/O beyond ``stat``: ``bundle_signature`` / ``dir_id`` describe one bundle
  directory, ``scan`` describes a whole repository (``name -> Snapshot``), and
  ``ChangeDetector`` turns a sequence of scans into ``Change`` events (load, reload, unload,
  rename) with a two-poll debounce and rename detection by directory identity;
* a thin async shell, ``watch``, that scans in a worker thread every ``poll_seconds`` and hands
  each change to the worker's ``apply`` coroutine, reporting the outcome back to the detector.

The watcher decides *what* to do; the worker's ``apply`` decides *how* (compiling off the
dispatch loop and swapping on it), so every other model keeps serving while one reloads.

A bundle is only acted on once it looked identical on two consecutive polls, so a bundle copied
in file by file is not loaded while the copy is still moving. A copy that stalls for longer than
two polls with its ``manifest.yaml`` already in place can still be seen half-written; the
robust way to publish a bundle is to write it elsewhere on the same filesystem and ``mv`` it in
(a rename, which the watcher also recognises as such when moving a served bundle).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.abc

from kserve_trio.core.bundles import MANIFEST_FILE, bundle_signature_files
from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.worker.watcher")

Signature = tuple[tuple[str, int, int], ...]
"""Sorted ``(relative filename, mtime_ns, size)`` over a bundle's signature files."""

DirId = tuple[int, int]
"""``(st_dev, st_ino)`` of a bundle directory: its identity across renames."""

Action = Literal["load", "reload", "unload", "rename"]


# --------------------------------------------------------------------------------------------
# Describing bundles on disk
# --------------------------------------------------------------------------------------------


def bundle_signature(bundle_dir: str | os.PathLike[str]) -> Signature:
    """What a bundle version looks like on disk, cheaply: names, mtimes and sizes.

    Covers every file ``bundle_signature_files`` lists (manifest, weights, ``model.py`` and every
    ``model*.mlir`` / ``model*.jaxexport``, variants included), so touching any of them is a
    change. Raises ``OSError`` when a file vanishes between listing and ``stat``: the caller
    treats that bundle as unreadable for this round.
    """
    entries = []
    for path in bundle_signature_files(bundle_dir):
        st = os.stat(path)
        entries.append((path.name, st.st_mtime_ns, st.st_size))
    return tuple(sorted(entries))


def dir_id(path: str | os.PathLike[str]) -> DirId:
    """``(st_dev, st_ino)`` of ``path`` (symlinks followed): survives ``mv`` on one filesystem."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


@dataclass(frozen=True)
class Snapshot:
    """One bundle as one scan saw it.

    ``error`` is set when the bundle could not be described this round (a file vanished
    mid-scan, a permission error, the same name in two model directories); such a snapshot never
    confirms a change, so a bundle in flux is simply looked at again on the next poll.
    """

    dir: pathlib.Path
    signature: Signature
    dir_id: DirId | None
    error: str | None = None

    @property
    def readable(self) -> bool:
        return self.error is None


def snapshot(bundle_dir: str | os.PathLike[str]) -> Snapshot:
    """Describe one bundle directory; an ``OSError`` becomes an unreadable ``Snapshot``."""
    path = pathlib.Path(bundle_dir)
    try:
        return Snapshot(path, bundle_signature(path), dir_id(path))
    except OSError as exc:
        return Snapshot(path, (), None, error=f"{type(exc).__name__}: {exc}")


def scan(
    model_dirs: Sequence[str | os.PathLike[str]], include: Iterable[str] = ()
) -> dict[str, Snapshot]:
    """``name -> Snapshot`` for every bundle in the repository right now.

    A bundle is an immediate subdirectory holding ``manifest.yaml``; its name is the directory's
    basename. A non-empty ``include`` keeps only those names. A missing or unreadable model
    directory is skipped. A problem with one bundle never fails the scan: that bundle gets an
    unreadable snapshot (``error`` set), including a name found in two model directories (the
    first directory's path is kept, marked ambiguous).
    """
    wanted = set(include)
    found: dict[str, Snapshot] = {}
    for root in model_dirs:
        try:
            children = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            continue
        for child in children:
            if wanted and child.name not in wanted:
                continue
            try:
                if not (child.is_dir() and os.path.isfile(os.path.join(child.path, MANIFEST_FILE))):
                    continue
            except OSError:
                continue
            path = pathlib.Path(child.path)
            if child.name in found:
                first = found[child.name].dir
                found[child.name] = Snapshot(
                    first,
                    (),
                    None,
                    error=f"duplicate model name '{child.name}': {first} and {path}",
                )
                continue
            found[child.name] = snapshot(path)
    return found


# --------------------------------------------------------------------------------------------
# Change detection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One confirmed repository change for the worker to apply.

    ``name`` is the model the change is about (for a rename: the *new* name, also available as
    ``new``); ``old`` is the previous name of a rename; ``dir`` is the bundle directory to load
    from (the leaving directory for an unload); ``snapshot`` is what the detector records as seen
    once the change is reported applied (``None`` for an unload).
    """

    action: Action
    name: str
    dir: pathlib.Path | None = None
    old: str | None = None
    snapshot: Snapshot | None = None

    @property
    def new(self) -> str:
        return self.name


class ChangeDetector:
    """Turns successive scans into debounced ``Change`` lists; remembers what the worker serves.

    ``seen`` is the repository as the worker last applied it, seeded from the startup scan (or
    from the subset the worker actually loaded: a seed without a bundle makes the watcher load it
    once it is confirmed). Only ``applied`` moves ``seen``; a failed change leaves it, so the
    difference is noticed again, confirmed again on the following poll and retried then: at
    most every other poll, never a spin.
    """

    def __init__(self, seed: Mapping[str, Snapshot] | None = None) -> None:
        self._seen: dict[str, Snapshot] = {
            name: snap for name, snap in (seed or {}).items() if snap.readable
        }
        # A pending or desired state of None means "no bundle under this name".
        self._pending: dict[str, Snapshot | None] = {}
        self._no_rename: set[DirId] = set()

    @property
    def seen(self) -> dict[str, Snapshot]:
        """A copy of the applied state, ``name -> Snapshot``."""
        return dict(self._seen)

    def poll(self, current: Mapping[str, Snapshot]) -> list[Change]:
        """Compare one scan with ``seen``; return the confirmed changes in a safe apply order.

        Rules, in order:

        1. *Differs*: a name differs when it is in ``current`` or ``seen`` and its snapshot
           (signature, directory identity, path) differs from the seen one, absence included. An
           unreadable snapshot never differs: that name is looked at again next poll.
        2. *Confirmed*: a differing name is confirmed when the previous poll recorded exactly the
           same state for it (same snapshot, or absent both times); otherwise its state is recorded
           in the new pending map. The pending map is replaced every poll, so a change must be
           identical on two consecutive polls, and a confirmed change is not re-recorded (a failed
           change is retried one confirmation later, not on every poll).
        3. *Rename*: a confirmed present name ``new`` whose directory identity differs from the
           one seen under ``new`` is the rename of ``old`` when ``old`` is a seen name (not yet
           claimed by another rename) with that directory identity and the same signature, and
           ``old`` is itself confirmed leaving (gone, or now a different directory). Renames that
           once failed to apply fall back to unload + load.
        4. *Order*: first unload confirmed removals that are not rename sources; then apply
           renames whose target name is free, repeating while that makes progress. A target
           held by the source of a pending rename waits for that rename; a target held by any
           other model is unloaded first. Renames left over form cycles: unload their sources,
           then load their targets. Last, every remaining confirmed present name is a
           ``reload`` when its name is still served and a ``load`` otherwise.
        """
        seen = self._seen
        next_pending: dict[str, Snapshot | None] = {}
        confirmed: dict[str, Snapshot | None] = {}
        for name in sorted(set(current) | set(seen)):
            desired = current.get(name)
            if desired is not None and not desired.readable:
                continue
            if desired == seen.get(name):
                continue
            if name in self._pending and self._pending[name] == desired:
                confirmed[name] = desired
            else:
                next_pending[name] = desired
        self._pending = next_pending

        renames = self._find_renames(confirmed)
        sources = {old: new for new, old in renames.items()}
        changes: list[Change] = []
        served = set(seen)

        def unload(name: str) -> None:
            changes.append(Change("unload", name, dir=seen[name].dir))
            served.discard(name)

        def load(name: str, snap: Snapshot) -> None:
            action: Action = "reload" if name in served else "load"
            changes.append(Change(action, name, dir=snap.dir, snapshot=snap))
            served.add(name)

        for name, desired in confirmed.items():
            if desired is None and name not in sources:
                unload(name)

        todo = dict(sorted(renames.items()))  # new -> old
        progress = True
        while todo and progress:
            progress = False
            for new, old in list(todo.items()):
                if new in served:
                    if new in todo.values():
                        continue  # held by a rename source that has not moved yet
                    unload(new)  # held by a model that is not moving: it is being replaced
                snap = confirmed[new]
                assert snap is not None
                changes.append(Change("rename", new, dir=snap.dir, old=old, snapshot=snap))
                served.discard(old)
                served.add(new)
                del todo[new]
                progress = True
        if todo:  # cycles: no rename can go first
            for old in sorted(todo.values()):
                if old in served:
                    unload(old)
            for new in sorted(todo):
                snap = confirmed[new]
                assert snap is not None
                load(new, snap)

        for name, desired in confirmed.items():
            if desired is not None and name not in renames:
                load(name, desired)
        return changes

    def _find_renames(self, confirmed: Mapping[str, Snapshot | None]) -> dict[str, str]:
        """*Rename* of ``poll``: ``new -> old`` for every confirmed rename."""
        seen = self._seen
        leaving = {
            name
            for name, desired in confirmed.items()
            if name in seen and (desired is None or desired.dir_id != seen[name].dir_id)
        }
        renames: dict[str, str] = {}
        claimed: set[str] = set()
        for new, desired in confirmed.items():
            if desired is None or desired.dir_id in self._no_rename:
                continue
            previous = seen.get(new)
            if previous is not None and previous.dir_id == desired.dir_id:
                continue
            for old in sorted(leaving - claimed - {new}):
                was = seen[old]
                if was.dir_id == desired.dir_id and was.signature == desired.signature:
                    renames[new] = old
                    claimed.add(old)
                    break
        return renames

    def ready(self, change: Change) -> bool:
        """Whether ``change`` still fits ``seen`` (an earlier change of its batch may have failed).

        A rename needs its source served and its target free, a load a free name, a reload or
        unload a served name. The shell skips a change that is not ready; it is found again and
        retried after the next confirmation.
        """
        seen = self._seen
        if change.action == "rename":
            return change.old in seen and change.name not in seen
        if change.action == "load":
            return change.name not in seen
        return change.name in seen

    def applied(self, change: Change) -> None:
        """The worker applied ``change``: record it in ``seen``."""
        if change.action == "unload":
            self._seen.pop(change.name, None)
            return
        assert change.snapshot is not None
        if change.action == "rename":
            assert change.old is not None
            self._seen.pop(change.old, None)
        self._seen[change.name] = change.snapshot
        if change.snapshot.dir_id is not None:
            self._no_rename.discard(change.snapshot.dir_id)

    def failed(self, change: Change) -> None:
        """The worker could not apply ``change``: leave ``seen`` as is so it is retried.

        A failed rename is retried as unload + load (a rename that cannot be applied would
        otherwise fail the same way forever).
        """
        if change.action == "rename" and change.snapshot and change.snapshot.dir_id is not None:
            self._no_rename.add(change.snapshot.dir_id)


# --------------------------------------------------------------------------------------------
# The async shell
# --------------------------------------------------------------------------------------------

Apply = Callable[[Change], Awaitable[None]]


async def poll_once(
    model_dirs: Sequence[str | os.PathLike[str]],
    include: Iterable[str],
    apply: Apply,
    detector: ChangeDetector,
) -> list[Change]:
    """One watcher round: scan in a worker thread, detect, apply each change in order.

    Returns the changes that were applied. A failing scan logs ``watcher_poll_failed`` and
    applies nothing; a failing ``apply`` logs ``watcher_apply_failed`` and is reported to the
    detector (so it is retried later) while the remaining changes still run.
    """
    include = tuple(include)
    try:
        current = await anyio.to_thread.run_sync(scan, model_dirs, include)
        changes = detector.poll(current)
    except Exception as exc:  # a round must never kill the watcher
        log.warning("watcher_poll_failed", error=f"{type(exc).__name__}: {exc}")
        return []
    done: list[Change] = []
    for change in changes:
        if not detector.ready(change):
            log.info(
                "watcher_change_deferred",
                action=change.action,
                model=change.name,
                reason="an earlier change of this round failed",
            )
            continue
        log.info(
            "watcher_change_detected",
            action=change.action,
            model=change.name,
            old=change.old,
            dir=str(change.dir) if change.dir is not None else None,
        )
        try:
            await apply(change)
        except Exception as exc:  # one bad bundle must not stop the others
            log.warning(
                "watcher_apply_failed",
                action=change.action,
                model=change.name,
                old=change.old,
                error=f"{type(exc).__name__}: {exc}",
            )
            detector.failed(change)
        else:
            detector.applied(change)
            done.append(change)
    return done


async def watch(
    model_dirs: Sequence[str | os.PathLike[str]],
    include: Iterable[str],
    poll_seconds: float,
    apply: Apply,
    detector: ChangeDetector,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Poll the repository forever: immediately, then every ``poll_seconds``; cancel to stop.

    ``task_status.started()`` fires after the first round, which never applies anything (a
    change needs two polls), so ``await tg.start(watch, ...)`` returns promptly with the
    watcher's first look taken.
    """
    include = tuple(include)
    model_dirs = tuple(model_dirs)
    await poll_once(model_dirs, include, apply, detector)
    task_status.started()
    while True:
        await anyio.sleep(poll_seconds)
        await poll_once(model_dirs, include, apply, detector)


__all__ = [
    "Change",
    "ChangeDetector",
    "DirId",
    "Signature",
    "Snapshot",
    "bundle_signature",
    "dir_id",
    "poll_once",
    "scan",
    "snapshot",
    "watch",
]
