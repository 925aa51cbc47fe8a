"""The conformance cases' server: one ``target`` per (engine, kind), started once for the
module, the cases of one target running together."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.grpc.conformance.targets import KINDS, Target, engines, running

TARGETS = [(engine, kind) for engine in engines() for kind in KINDS]


@pytest.fixture(
    scope="module",
    params=TARGETS,
    ids=[kind if engine is None else f"{engine}-{kind}" for engine, kind in TARGETS],
)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    engine, kind = request.param
    with running(kind, engine, tmp_path_factory.mktemp(f"conformance-{kind}")) as served:
        yield served
