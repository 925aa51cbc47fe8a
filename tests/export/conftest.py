"""Export fixtures: a session-wide CPU backend and the demo repository."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def backend():
    from kserve_trio.runtime import JaxBackend

    return JaxBackend.create("cpu")


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from kserve_trio.export.demo import write_demo_repository

    root = tmp_path_factory.mktemp("demo")
    write_demo_repository(root)
    return root


def git(cwd: pathlib.Path, *args: str) -> str:
    import subprocess

    res = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd,
        capture_output=True,
        check=True,
        text=True,
    )
    return res.stdout
