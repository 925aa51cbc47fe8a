"""The suite's longest files are handed out first (tests/conftest.py, ``LONGEST_FILES_FIRST``)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from tests.conftest import _REPO, LONGEST_FILES_FIRST


def test_every_listed_file_exists():
    missing = [name for name in LONGEST_FILES_FIRST if not (_REPO / name).is_file()]
    assert missing == []


def test_collection_puts_the_listed_files_first_in_their_order():
    chosen = [LONGEST_FILES_FIRST[2], "tests/test_ports.py", LONGEST_FILES_FIRST[0]]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *chosen],
        cwd=_REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = []
    for line in out.splitlines():
        if "::" in line:
            name = pathlib.PurePosixPath(line.split("::")[0]).as_posix()
            if not files or files[-1] != name:
                files.append(name)
    assert files == [LONGEST_FILES_FIRST[0], LONGEST_FILES_FIRST[2], "tests/test_ports.py"]


def test_the_test_command_hands_files_out_in_collection_order():
    """pytest-xdist reorders files by their number of tests unless told not to, which would
    undo the order above: the long files, few tests each, would run last."""
    command = next(
        line
        for line in (_REPO / "tools" / "dev.sh").read_text().splitlines()
        if '-n "$procs"' in line
    )
    assert "--dist loadfile" in command and "--no-loadscope-reorder" in command, command
