"""The repository watcher: signatures, scans, the two-poll debounce, renames, retries, the shell."""

from __future__ import annotations

import os
import pathlib
import shutil

import anyio
import pytest
from structlog.testing import capture_logs

from kserve_trio.worker import watcher
from kserve_trio.worker.watcher import (
    Change,
    ChangeDetector,
    Snapshot,
    bundle_signature,
    dir_id,
    poll_once,
    scan,
    watch,
)

# ----------------------------------------------------------------------------- helpers


def make_bundle(root: pathlib.Path, name: str, *, weights: bytes = b"w" * 8) -> pathlib.Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "manifest.yaml").write_text(f"name: {name}\n")
    (d / "weights.safetensors").write_bytes(weights)
    (d / "model.mlir").write_bytes(b"mlir")
    return d


def touch(path: pathlib.Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))


def summary(changes: list[Change]) -> list[tuple]:
    return [
        (c.action, c.old, c.name) if c.action == "rename" else (c.action, c.name) for c in changes
    ]


def settle(det: ChangeDetector, repo: pathlib.Path) -> list[Change]:
    """Two polls over an unchanged repository, applying whatever they confirm."""
    changes = det.poll(scan([repo])) + det.poll(scan([repo]))
    for c in changes:
        det.applied(c)
    return changes


def applied_all(det: ChangeDetector, changes: list[Change]) -> list[Change]:
    for c in changes:
        assert det.ready(c), c
        det.applied(c)
    return changes


@pytest.fixture
def repo(tmp_path: pathlib.Path) -> pathlib.Path:
    r = tmp_path / "models"
    r.mkdir()
    return r


# ----------------------------------------------------------------------------- signature


def test_signature_lists_bundle_files_with_mtime_and_size(repo):
    d = make_bundle(repo, "m")
    (d / "README.md").write_text("not a bundle file")
    for f in ("manifest.yaml", "weights.safetensors", "model.mlir"):
        touch(d / f, 1_000_000_000)
    assert bundle_signature(d) == (
        ("manifest.yaml", 1_000_000_000, 8),
        ("model.mlir", 1_000_000_000, 4),
        ("weights.safetensors", 1_000_000_000, 8),
    )


def test_signature_changes_with_content_and_with_mtime(repo):
    d = make_bundle(repo, "m")
    before = bundle_signature(d)
    (d / "weights.safetensors").write_bytes(b"w" * 9)
    resized = bundle_signature(d)
    assert resized != before
    touch(d / "manifest.yaml", 42)
    assert bundle_signature(d) != resized


@pytest.mark.parametrize(
    "filename",
    ["model.v1.mlir", "model.v2.b8.mlir", "model.jaxexport", "model.v0.jaxexport", "model.py"],
)
def test_signature_covers_variants_jaxexport_and_model_py(repo, filename):
    d = make_bundle(repo, "m")
    before = bundle_signature(d)
    (d / filename).write_bytes(b"x")
    after = bundle_signature(d)
    assert filename in [e[0] for e in after]
    touch(d / filename, 7)
    assert bundle_signature(d) != after != before


def test_signature_ignores_unrelated_files(repo):
    d = make_bundle(repo, "m")
    before = bundle_signature(d)
    (d / "notes.txt").write_text("hello")
    (d / "other.mlir").write_text("not model*")
    assert bundle_signature(d) == before


def test_dir_id_survives_a_rename_and_differs_between_directories(repo):
    a = make_bundle(repo, "a")
    b = make_bundle(repo, "b")
    ident = dir_id(a)
    assert ident != dir_id(b)
    os.rename(a, repo / "c")
    assert dir_id(repo / "c") == ident


# ----------------------------------------------------------------------------- scan


def test_scan_names_bundles_by_directory_and_skips_non_bundles(repo):
    make_bundle(repo, "alpha")
    (repo / "empty_dir").mkdir()
    (repo / "stray.txt").write_text("x")
    result = scan([repo])
    assert list(result) == ["alpha"]
    snap = result["alpha"]
    assert snap.dir == repo / "alpha"
    assert snap.readable and snap.error is None
    assert snap.signature == bundle_signature(repo / "alpha")
    assert snap.dir_id == dir_id(repo / "alpha")


def test_scan_honors_include_and_skips_missing_roots(tmp_path, repo):
    make_bundle(repo, "a")
    make_bundle(repo, "b")
    other = tmp_path / "other"
    make_bundle(other, "c")
    assert sorted(scan([tmp_path / "missing", repo, other])) == ["a", "b", "c"]
    assert sorted(scan([repo, other], include=["a", "c", "zzz"])) == ["a", "c"]


def test_scan_marks_a_duplicate_name_unreadable_without_failing(tmp_path, repo):
    make_bundle(repo, "dup")
    make_bundle(repo, "ok")
    other = tmp_path / "other"
    make_bundle(other, "dup")
    result = scan([repo, other])
    assert result["ok"].readable
    assert not result["dup"].readable
    assert result["dup"].dir == repo / "dup"
    assert result["dup"].error == f"duplicate model name 'dup': {repo / 'dup'} and {other / 'dup'}"


def test_scan_survives_a_bundle_vanishing_mid_scan(repo, monkeypatch):
    make_bundle(repo, "gone")
    make_bundle(repo, "ok")
    real = watcher.bundle_signature_files

    def racing(bundle_dir):
        files = real(bundle_dir)
        if pathlib.Path(bundle_dir).name == "gone":
            shutil.rmtree(bundle_dir)
        return files

    monkeypatch.setattr(watcher, "bundle_signature_files", racing)
    result = scan([repo])
    assert result["ok"].readable
    assert not result["gone"].readable
    assert result["gone"].error.startswith("FileNotFoundError: ")


# ----------------------------------------------------------------------------- debounce


def test_first_poll_after_seeding_is_a_no_op(repo):
    make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    assert det.poll(scan([repo])) == []
    assert det.poll(scan([repo])) == []
    assert list(det.seen) == ["a"]


def test_load_needs_exactly_two_polls(repo):
    det = ChangeDetector(scan([repo]))
    make_bundle(repo, "a")
    assert det.poll(scan([repo])) == []
    changes = det.poll(scan([repo]))
    assert summary(changes) == [("load", "a")]
    assert changes[0].dir == repo / "a"
    assert changes[0].snapshot == scan([repo])["a"]
    applied_all(det, changes)
    assert det.poll(scan([repo])) == []
    assert list(det.seen) == ["a"]


def test_reload_needs_exactly_two_polls(repo):
    d = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    (d / "model.v1.mlir").write_bytes(b"variant")
    assert det.poll(scan([repo])) == []
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("reload", "a")]
    assert det.seen["a"].signature == bundle_signature(d)
    assert det.poll(scan([repo])) == []


def test_unload_needs_exactly_two_polls(repo):
    d = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    shutil.rmtree(d)
    assert det.poll(scan([repo])) == []
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("unload", "a")]
    assert changes[0].dir == repo / "a"
    assert det.seen == {}


def test_a_bundle_copied_in_slowly_is_reported_only_after_two_identical_polls(repo):
    det = ChangeDetector(scan([repo]))
    d = repo / "slow"
    d.mkdir()
    (d / "manifest.yaml").write_text("name: slow\n")
    assert det.poll(scan([repo])) == []
    (d / "model.mlir").write_bytes(b"m")
    assert det.poll(scan([repo])) == []
    (d / "weights.safetensors").write_bytes(b"w")
    assert det.poll(scan([repo])) == []
    with open(d / "weights.safetensors", "ab") as f:  # still growing
        f.write(b"ww")
    assert det.poll(scan([repo])) == []
    (d / "model.py").write_text("# hooks\n")
    assert det.poll(scan([repo])) == []
    # the copy is done: one more poll sees it unchanged
    changes = det.poll(scan([repo]))
    assert summary(changes) == [("load", "slow")]
    assert [e[0] for e in changes[0].snapshot.signature] == [
        "manifest.yaml",
        "model.mlir",
        "model.py",
        "weights.safetensors",
    ]


def test_a_change_that_reverts_within_the_debounce_is_never_reported(repo):
    d = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    original = os.stat(d / "manifest.yaml").st_mtime_ns
    touch(d / "manifest.yaml", 5)
    assert det.poll(scan([repo])) == []
    touch(d / "manifest.yaml", original)
    assert det.poll(scan([repo])) == []
    assert det.poll(scan([repo])) == []


def test_an_unreadable_bundle_confirms_nothing_and_restarts_its_debounce(repo):
    det = ChangeDetector({})
    make_bundle(repo, "a")
    good = scan([repo])
    bad = {"a": Snapshot(repo / "a", (), None, error="PermissionError: denied")}
    assert det.poll(good) == []
    assert det.poll(bad) == []
    assert det.poll(good) == []  # the pending record was dropped by the unreadable round
    assert summary(det.poll(good)) == [("load", "a")]


def test_a_seen_bundle_turning_unreadable_is_not_unloaded(repo):
    make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    bad = {"a": Snapshot(repo / "a", (), None, error="PermissionError: denied")}
    assert det.poll(bad) == []
    assert det.poll(bad) == []
    assert list(det.seen) == ["a"]


def test_unreadable_seed_entries_are_left_out_of_seen(repo):
    make_bundle(repo, "a")
    seed = scan([repo]) | {"b": Snapshot(repo / "b", (), None, error="OSError: boom")}
    assert list(ChangeDetector(seed).seen) == ["a"]


# ----------------------------------------------------------------------------- renames


def test_a_renamed_directory_is_one_rename_not_unload_and_load(repo):
    a = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    os.rename(a, repo / "b")
    assert det.poll(scan([repo])) == []
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("rename", "a", "b")]
    assert changes[0].new == "b"
    assert changes[0].dir == repo / "b"
    assert list(det.seen) == ["b"]
    assert det.seen["b"].dir == repo / "b"
    assert det.poll(scan([repo])) == []


def test_a_renamed_and_modified_directory_is_unload_and_load(repo):
    a = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    os.rename(a, repo / "b")
    (repo / "b" / "weights.safetensors").write_bytes(b"changed!!")
    det.poll(scan([repo]))
    assert summary(det.poll(scan([repo]))) == [("unload", "a"), ("load", "b")]


def test_a_copy_is_a_load_not_a_rename(repo):
    a = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    shutil.copytree(a, repo / "b", copy_function=shutil.copy2)
    det.poll(scan([repo]))
    assert summary(det.poll(scan([repo]))) == [("load", "b")]


def test_a_promotion_chain_resolves_as_two_renames_in_a_safe_order(repo):
    make_bundle(repo, "m-production", weights=b"v1")
    make_bundle(repo, "m-staging", weights=b"v2-new")
    det = ChangeDetector(scan([repo]))
    v1, v2 = det.seen["m-production"].dir_id, det.seen["m-staging"].dir_id
    os.rename(repo / "m-production", repo / "m-production-old")
    os.rename(repo / "m-staging", repo / "m-production")
    assert det.poll(scan([repo])) == []
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [
        ("rename", "m-production", "m-production-old"),
        ("rename", "m-staging", "m-production"),
    ]
    assert det.seen["m-production"].dir_id == v2
    assert det.seen["m-production-old"].dir_id == v1
    assert sorted(det.seen) == ["m-production", "m-production-old"]


def test_rm_then_rename_onto_the_name_unloads_the_occupant_first(repo):
    make_bundle(repo, "m", weights=b"old")
    make_bundle(repo, "m2", weights=b"newer")
    det = ChangeDetector(scan([repo]))
    shutil.rmtree(repo / "m")
    os.rename(repo / "m2", repo / "m")
    assert det.poll(scan([repo])) == []
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("unload", "m"), ("rename", "m2", "m")]
    assert list(det.seen) == ["m"]
    assert det.seen["m"].signature == bundle_signature(repo / "m")


def test_moving_a_bundle_aside_and_putting_a_fresh_one_in_its_place(repo):
    make_bundle(repo, "m", weights=b"old")
    det = ChangeDetector(scan([repo]))
    os.rename(repo / "m", repo / "m-old")
    make_bundle(repo, "m", weights=b"fresh")
    det.poll(scan([repo]))
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("rename", "m", "m-old"), ("load", "m")]


def test_a_swap_cycle_falls_back_to_unload_and_load(repo):
    make_bundle(repo, "a", weights=b"A")
    make_bundle(repo, "b", weights=b"BB")
    det = ChangeDetector(scan([repo]))
    os.rename(repo / "a", repo / "tmp")
    os.rename(repo / "b", repo / "a")
    os.rename(repo / "tmp", repo / "b")
    det.poll(scan([repo]))
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("unload", "a"), ("unload", "b"), ("load", "a"), ("load", "b")]
    assert det.seen == scan([repo])


def test_a_rename_between_model_directories_on_one_filesystem(tmp_path, repo):
    other = tmp_path / "other"
    other.mkdir()
    make_bundle(repo, "m")
    det = ChangeDetector(scan([repo, other]))
    os.rename(repo / "m", other / "m2")
    det.poll(scan([repo, other]))
    changes = det.poll(scan([repo, other]))
    assert summary(changes) == [("rename", "m", "m2")]
    assert changes[0].dir == other / "m2"


# ----------------------------------------------------------------------------- outcomes


def test_a_failed_load_is_retried_on_the_next_confirmation_not_every_poll(repo):
    det = ChangeDetector({})
    make_bundle(repo, "a")
    assert det.poll(scan([repo])) == []
    first = det.poll(scan([repo]))
    assert summary(first) == [("load", "a")]
    det.failed(first[0])
    assert det.seen == {}
    assert det.poll(scan([repo])) == []  # re-recorded, not re-issued at once
    second = det.poll(scan([repo]))
    assert summary(second) == [("load", "a")]
    applied_all(det, second)
    assert list(det.seen) == ["a"]


def test_a_failed_unload_is_retried(repo):
    d = make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    shutil.rmtree(d)
    det.poll(scan([repo]))
    (change,) = det.poll(scan([repo]))
    det.failed(change)
    assert list(det.seen) == ["a"]
    det.poll(scan([repo]))
    assert summary(det.poll(scan([repo]))) == [("unload", "a")]


def test_a_failed_rename_falls_back_to_unload_and_load(repo):
    make_bundle(repo, "a")
    det = ChangeDetector(scan([repo]))
    os.rename(repo / "a", repo / "b")
    det.poll(scan([repo]))
    (rename,) = det.poll(scan([repo]))
    assert rename.action == "rename"
    det.failed(rename)
    assert list(det.seen) == ["a"]
    det.poll(scan([repo]))
    changes = applied_all(det, det.poll(scan([repo])))
    assert summary(changes) == [("unload", "a"), ("load", "b")]
    # the fallback is forgotten once applied: a later rename of b is a rename again
    os.rename(repo / "b", repo / "c")
    det.poll(scan([repo]))
    assert summary(det.poll(scan([repo]))) == [("rename", "b", "c")]


def test_ready_refuses_a_change_whose_prerequisite_failed(repo):
    make_bundle(repo, "m-production", weights=b"v1")
    make_bundle(repo, "m-staging", weights=b"v2-new")
    det = ChangeDetector(scan([repo]))
    os.rename(repo / "m-production", repo / "m-production-old")
    os.rename(repo / "m-staging", repo / "m-production")
    det.poll(scan([repo]))
    first, second = det.poll(scan([repo]))
    det.failed(first)
    assert not det.ready(second)  # m-production is still served under its old directory
    assert det.ready(first)
    assert not det.ready(Change("load", "m-production"))
    assert not det.ready(Change("unload", "nobody"))
    assert det.ready(Change("reload", "m-staging"))


# ----------------------------------------------------------------------------- async shell


@pytest.mark.anyio
async def test_watch_sees_add_then_rename_then_delete_in_order(repo):
    det = ChangeDetector(scan([repo]))
    send, receive = anyio.create_memory_object_stream[Change](10)
    applied: list[Change] = []

    async def apply(change: Change) -> None:
        applied.append(change)
        await send.send(change)

    async def next_change() -> Change:
        with anyio.fail_after(5):
            return await receive.receive()

    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(watch, [repo], (), 0.05, apply, det)
            make_bundle(repo, "a")
            added = await next_change()
            os.rename(repo / "a", repo / "b")
            renamed = await next_change()
            shutil.rmtree(repo / "b")
            removed = await next_change()
            tg.cancel_scope.cancel()
    assert summary([added, renamed, removed]) == [
        ("load", "a"),
        ("rename", "a", "b"),
        ("unload", "b"),
    ]
    assert applied == [added, renamed, removed]
    assert det.seen == {}
    detected = [(e["action"], e["model"]) for e in logs if e["event"] == "watcher_change_detected"]
    assert detected == [("load", "a"), ("rename", "b"), ("unload", "b")]


@pytest.mark.anyio
async def test_poll_once_reports_a_failing_apply_and_keeps_going(repo):
    make_bundle(repo, "bad")
    make_bundle(repo, "good")
    det = ChangeDetector({})

    async def apply(change: Change) -> None:
        if change.name == "bad":
            raise RuntimeError("compile failed")

    with capture_logs() as logs:
        assert await poll_once([repo], (), apply, det) == []
        done = await poll_once([repo], (), apply, det)
    assert summary(done) == [("load", "good")]
    assert list(det.seen) == ["good"]
    failures = [e for e in logs if e["event"] == "watcher_apply_failed"]
    assert len(failures) == 1
    assert failures[0]["model"] == "bad"
    assert failures[0]["action"] == "load"
    assert failures[0]["error"] == "RuntimeError: compile failed"
    # retried on the next confirmation, and this time it works
    assert await poll_once([repo], (), apply, det) == []
    ok: list[Change] = []

    async def apply_ok(change: Change) -> None:
        ok.append(change)

    assert summary(await poll_once([repo], (), apply_ok, det)) == [("load", "bad")]
    assert sorted(det.seen) == ["bad", "good"]


@pytest.mark.anyio
async def test_poll_once_skips_a_change_that_is_no_longer_ready(repo):
    make_bundle(repo, "m-production", weights=b"v1")
    make_bundle(repo, "m-staging", weights=b"v2-new")
    det = ChangeDetector(scan([repo]))
    os.rename(repo / "m-production", repo / "m-production-old")
    os.rename(repo / "m-staging", repo / "m-production")
    calls: list[Change] = []

    async def apply(change: Change) -> None:
        calls.append(change)
        raise RuntimeError("registry refused")

    with capture_logs() as logs:
        await poll_once([repo], (), apply, det)
        await poll_once([repo], (), apply, det)
    assert summary(calls) == [("rename", "m-production", "m-production-old")]
    deferred = [e for e in logs if e["event"] == "watcher_change_deferred"]
    assert [(e["action"], e["model"]) for e in deferred] == [("rename", "m-production")]


@pytest.mark.anyio
async def test_a_failing_scan_only_warns_and_the_watcher_keeps_polling(repo, monkeypatch):
    rounds = 0
    real_scan = watcher.scan

    def flaky(model_dirs, include):
        nonlocal rounds
        rounds += 1
        if rounds == 2:
            raise OSError("disk went away")
        return real_scan(model_dirs, include)

    monkeypatch.setattr(watcher, "scan", flaky)
    det = ChangeDetector({})
    make_bundle(repo, "a")
    seen: list[Change] = []
    done = anyio.Event()

    async def apply(change: Change) -> None:
        seen.append(change)
        done.set()

    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, [repo], (), 0.01, apply, det)
            with anyio.fail_after(5):
                await done.wait()
            tg.cancel_scope.cancel()
    assert summary(seen) == [("load", "a")]
    failures = [e for e in logs if e["event"] == "watcher_poll_failed"]
    assert failures[0]["error"] == "OSError: disk went away"
    assert failures[0]["log_level"] == "warning"
