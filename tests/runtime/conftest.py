"""Runtime fixtures: one CPU backend per session and small bundles exported in-process."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kserve_trio.runtime import JaxBackend


@pytest.fixture(scope="session")
def backend() -> JaxBackend:
    return JaxBackend.create("cpu")


@pytest.fixture(scope="session")
def demo_bundles(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The demo repository, written once per session (about two seconds)."""
    from kserve_trio.export.demo import write_demo_repository

    root = tmp_path_factory.mktemp("demo")
    write_demo_repository(root)
    return root


def mlp_fn(x, w1, b1, w2, b2):
    import jax.numpy as jnp

    return jnp.maximum(x @ w1 + b1, 0) @ w2 + b2


def two_in_two_out(a, b, w, c):
    """Multi-input / multi-output: ``(a @ w + c, (a * b).sum(-1))``."""
    return a @ w + c, (a * b).sum(axis=-1)


def rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)
