"""Reproducibility provenance for exported bundles (``collect_provenance``).

What a bundle's ``provenance`` block records about where it came from: the export environment
(time, Python and kserve_trio versions) and, best-effort, the state of the model's git work tree.
A dirty tree's uncommitted changes travel as ``git_diff``, which ``write_bundle`` moves into a
``working_tree.patch`` file next to the manifest.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kserve_trio.core.logging import get_logger

log = get_logger(__name__)

MAX_DIFF_BYTES = 20 * 1024 * 1024
"""A larger diff is left out (``git_diff_omitted`` says why) rather than bloating the bundle."""


def kserve_trio_version() -> str:
    """The installed kserve_trio version (``unknown`` when it is not installed as a package)."""
    try:
        from importlib.metadata import version

        return version("kserve_trio")
    except Exception:
        return "unknown"


def _git(repo: Path, *args: str) -> str | None:
    """Output of ``git -C repo args`` (bytes decoded, trailing newline kept), or None."""
    try:
        res = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.decode("utf-8", errors="surrogateescape")


def collect_provenance(
    repo_dir: str | os.PathLike[str] | None = None, *, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Best-effort provenance of an export run from the repository at ``repo_dir`` (default: the
    current directory). Never raises. Fields:

    1. always: ``exported_at`` (UTC ISO-8601 with ``Z``), ``python_version``,
       ``kserve_trio_version``;
    2. inside a git work tree: ``git_commit``, ``git_tree_sha1``, ``git_branch`` (absent on a
       detached HEAD), ``git_dirty`` (tracked files changed), ``repo_remote`` (the ``origin``
       URL, when there is one), and for a dirty tree ``git_diff`` = ``git diff --binary HEAD``
       verbatim (left out above 20 MiB, with ``git_diff_omitted`` giving the size);
    3. outside a work tree (or without git): a warning and no git fields;
    4. ``extra`` is merged last and overrides collected fields.
    """
    repo = Path(repo_dir) if repo_dir is not None else Path.cwd()
    out: dict[str, Any] = {
        "exported_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python_version": platform.python_version(),
        "kserve_trio_version": kserve_trio_version(),
    }
    inside = _git(repo, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != "true":
        log.warning("provenance_no_git", repo_dir=str(repo), reason="not inside a git work tree")
    else:
        commit = _git(repo, "rev-parse", "HEAD")
        if commit:
            out["git_commit"] = commit.strip()
        tree = _git(repo, "rev-parse", "HEAD^{tree}")
        if tree:
            out["git_tree_sha1"] = tree.strip()
        branch = _git(repo, "symbolic-ref", "--short", "-q", "HEAD")
        if branch and branch.strip():
            out["git_branch"] = branch.strip()
        status = _git(repo, "status", "--porcelain", "--untracked-files=no")
        if status is not None:
            dirty = bool(status.strip())
            out["git_dirty"] = dirty
            if dirty and commit:
                diff = _git(repo, "diff", "--binary", "HEAD")
                if diff is not None:
                    size = len(diff.encode("utf-8", errors="surrogateescape"))
                    if size > MAX_DIFF_BYTES:
                        out["git_diff_omitted"] = f"diff is {size} bytes (limit {MAX_DIFF_BYTES})"
                    else:
                        out["git_diff"] = diff
        remote = _git(repo, "remote", "get-url", "origin")
        if remote and remote.strip():
            out["repo_remote"] = remote.strip()
    if extra:
        out.update(extra)
    return out


__all__ = ["MAX_DIFF_BYTES", "collect_provenance", "kserve_trio_version"]
