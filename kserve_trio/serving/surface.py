"""What both servers (worker and gateway) say about themselves on either protocol: the server
name and the extensions ``ServerMetadata`` reports, and the KServe/Triton RPCs neither answers
with the reason the UNIMPLEMENTED (gRPC) or 501 (REST) reply gives. One owner, so the adapters
cannot drift."""

from __future__ import annotations

from collections.abc import Mapping

SERVER_NAME = "kserve_trio"
"""``ServerMetadata.name`` of the worker and the gateway."""

EXTENSIONS = (
    "model_repository",
    "model_configuration",
    "system_shared_memory",
    "parameters",
    "statistics",
    "trace",
    "logging",
)
"""What ``ServerMetadata`` lists, by Triton's names and in Triton's order: the extensions both
servers answer (docs/protocol.md says why the others are left out). A worker without a
shared-memory registry leaves ``system_shared_memory`` out."""

UNIMPLEMENTED_RPCS: Mapping[str, str] = {
    "CudaSharedMemoryStatus": "CUDA shared memory is not supported",
    "CudaSharedMemoryRegister": "CUDA shared memory is not supported",
    "CudaSharedMemoryUnregister": "CUDA shared memory is not supported",
}
"""The ``inference.GRPCInferenceService`` RPCs no server here answers, with the reason."""


__all__ = ["EXTENSIONS", "SERVER_NAME", "UNIMPLEMENTED_RPCS"]
