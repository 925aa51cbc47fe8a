"""collect_provenance: clean tree, dirty tree (diff captured verbatim), no repository, overrides."""

from __future__ import annotations

import platform
import re

import pytest

from kserve_trio.export import collect_provenance

from .conftest import git


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "model.py").write_text("x = 1\n")
    git(r, "add", "model.py")
    git(r, "commit", "-q", "-m", "first")
    git(r, "remote", "add", "origin", "https://example.com/models.git")
    return r


def test_clean_repository(repo):
    p = collect_provenance(repo)
    assert p["git_commit"] == git(repo, "rev-parse", "HEAD").strip()
    assert p["git_tree_sha1"] == git(repo, "rev-parse", "HEAD^{tree}").strip()
    assert p["git_branch"] == "main"
    assert p["git_dirty"] is False
    assert "git_diff" not in p
    assert p["repo_remote"] == "https://example.com/models.git"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["exported_at"])
    assert p["python_version"] == platform.python_version()
    assert p["kserve_trio_version"]


def test_dirty_repository_captures_the_diff_with_its_trailing_newline(repo):
    (repo / "model.py").write_text("x = 2\n")
    (repo / "untracked.py").write_text("ignored\n")
    p = collect_provenance(repo)
    assert p["git_dirty"] is True
    assert p["git_diff"] == git(repo, "diff", "--binary", "HEAD")
    assert p["git_diff"].endswith("+x = 2\n")
    assert "untracked.py" not in p["git_diff"]


def test_untracked_files_alone_do_not_make_a_tree_dirty(repo):
    (repo / "scratch.txt").write_text("notes\n")
    assert collect_provenance(repo)["git_dirty"] is False


def test_outside_a_repository_there_are_no_git_fields(tmp_path):
    p = collect_provenance(tmp_path)
    assert not [k for k in p if k.startswith("git_") or k == "repo_remote"]
    assert set(p) == {"exported_at", "python_version", "kserve_trio_version"}


def test_extra_overrides_collected_fields(repo):
    p = collect_provenance(repo, extra={"git_branch": "release", "model_card": "v3"})
    assert p["git_branch"] == "release" and p["model_card"] == "v3"


def test_a_diff_bundle_round_trip(repo, tmp_path):
    """The patch in a written bundle reapplies onto the recorded commit."""
    import numpy as np

    from kserve_trio.export import export_bundle

    (repo / "model.py").write_text("x = 3\n")
    prov = collect_provenance(repo)
    d = export_bundle(
        "jax",
        lambda x: x * 2,
        np.ones((1, 2), np.float32),
        None,
        dir=tmp_path / "b",
        batch_sizes=[1],
        provenance=prov,
    )
    patch = (d / "working_tree.patch").read_text()
    assert patch == prov["git_diff"]
    git(repo, "checkout", "-q", "--", "model.py")
    git(repo, "apply", str(d / "working_tree.patch"))
    assert (repo / "model.py").read_text() == "x = 3\n"
