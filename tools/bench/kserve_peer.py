"""KServe's Python model server with ``identity`` and ``sum``: the peer of the REST and gRPC benchmarks.

Runs from ``.venv-kserve`` (tools/bench/setup_kserve.sh), never from ``.venv``:

    .venv-kserve/bin/python tools/bench/kserve_peer.py --http_port 8080 --grpc_port 8081

``identity`` returns ``INPUT0`` as ``OUTPUT0`` (same shape and datatype), in binary when the
request asked for binary outputs (``binary_data_output`` or an output's ``binary_data``),
else as JSON: the same contract the benchmark's kserve_trio bundles serve. ``sum`` answers
``INPUT0.sum(axis=-1, keepdims=True)`` as ``OUTPUT0`` in the input's datatype, the same way
(tools/bench/peers.py). All flags are ``kserve.model_server``'s own.
"""

from __future__ import annotations

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from kserve.model_server import parser as kserve_parser


def wants_binary(payload: InferRequest) -> bool:
    params = payload.parameters or {}
    if params.get("binary_data_output"):
        return True
    for out in payload.request_outputs or []:
        if (out.parameters or {}).get("binary_data"):
            return True
    return False


class Identity(Model):
    """Answers ``OUTPUT0 = compute(INPUT0)``; the base answers the input itself."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.ready = False

    def load(self) -> bool:
        self.ready = True
        return self.ready

    async def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        x = self.compute(payload.inputs[0].as_numpy())
        binary = wants_binary(payload)
        out = InferOutput(name="OUTPUT0", shape=list(x.shape), datatype=payload.inputs[0].datatype)
        out.set_data_from_numpy(x, binary_data=binary)
        return InferResponse(
            model_name=self.name,
            infer_outputs=[out],
            response_id=payload.id or "",
            use_binary_outputs=binary,
        )

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x


class Sum(Identity):
    """``OUTPUT0 = INPUT0.sum(axis=-1, keepdims=True)``, kept in the input's dtype."""

    def compute(self, x: np.ndarray) -> np.ndarray:
        return x.sum(axis=-1, keepdims=True, dtype=x.dtype)


if __name__ == "__main__":
    kserve_parser.parse_known_args()
    models = [Identity("identity"), Sum("sum")]
    for model in models:
        model.load()
    ModelServer().start(models)
