"""The codec's metadata encoders: ``ModelMetadataResponse`` and ``RepositoryIndexResponse``
(betterproto2 messages: neither is on a per-inference path)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kserve_trio.core.protocol.codec._types import BUNDLE_VERSION
from kserve_trio.proto import inference as pb

if TYPE_CHECKING:
    from kserve_trio.core.bundles import Manifest, TensorSpec


def encode_model_metadata(name: str, manifest: Manifest, platform: str) -> pb.ModelMetadataResponse:
    """``ModelMetadataResponse`` from the manifest's client-facing specs (wire shapes, -1 for
    batch and variable axes, ``versions=["1"]``: a bundle is served as ``BUNDLE_VERSION``)."""

    def meta(spec: TensorSpec) -> pb.ModelMetadataResponseTensorMetadata:
        return pb.ModelMetadataResponseTensorMetadata(
            name=spec.name, datatype=spec.dtype.wire, shape=list(spec.wire_shape())
        )

    return pb.ModelMetadataResponse(
        name=name,
        versions=[BUNDLE_VERSION],
        platform=platform,
        inputs=[meta(s) for s in manifest.wire_inputs],
        outputs=[meta(s) for s in manifest.wire_outputs],
    )


def encode_repository_index(
    entries: Iterable[str] | Iterable[tuple[str, bool]] | Iterable[tuple[str, bool, str]],
) -> pb.RepositoryIndexResponse:
    """``RepositoryIndexResponse`` in the given order: a bare name is READY, a ``(name, ready)``
    pair is READY or UNAVAILABLE, a ``(name, ready, reason)`` triple also carries why it is not
    ready (a bundle that failed to load). Sorting and filtering are the caller's business."""
    models = []
    for entry in entries:
        reason = ""
        if isinstance(entry, str):
            name, ready = entry, True
        elif len(entry) == 3:
            name, ready, reason = entry
        else:
            name, ready = entry
        models.append(
            pb.RepositoryIndexResponseModelIndex(
                name=name,
                version=BUNDLE_VERSION,
                state="READY" if ready else "UNAVAILABLE",
                reason=reason,
            )
        )
    return pb.RepositoryIndexResponse(models=models)
