"""The demo model repository written by ``python -m kserve_trio bundle demo DIR``.

Five small bundles that exercise every path of the server without downloading anything (weights
from ``numpy.random.default_rng(0)``): ``mlp`` (four batch sizes), ``cnn`` (NCHW convolution),
``scale4`` (the upstream test fixture, a hand-written StableHLO module with no ``.jaxexport``, as
any non-jax producer would ship it), ``mlp_bf16`` and ``mlp_softmax`` (a ``model.py`` postprocess
with a different client output). The ``*_reference`` functions compute the same numbers in numpy
for tests and examples.

One more is written on request (``bundle demo DIR --only tokenize_sum``; ``EXTRA_DEMO_MODELS``):
``tokenize_sum``, string tensors through hooks. Its client input is ``BYTES`` text; the
``model.py`` preprocess tokenizes it into integer tensors, the executable sums them, and the
postprocess returns an integer output and a ``BYTES`` label.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from kserve_trio.core.bundles import MODEL_PY
from kserve_trio.export.frontends import export_bundle
from kserve_trio.export.iospec import IOSpec
from kserve_trio.export.writer import write_bundle

DEMO_MODELS: tuple[str, ...] = ("mlp", "cnn", "scale4", "mlp_bf16", "mlp_softmax")
"""What ``bundle demo DIR`` writes (the repository the docs and tests are built around)."""
EXTRA_DEMO_MODELS: tuple[str, ...] = ("tokenize_sum",)
"""Demo bundles written only when named (``--only NAME``)."""
TOKENIZE_BATCH_SIZES = (1, 8, 32)
MAX_TOKENS = 16
MLP_BATCH_SIZES = (1, 8, 32, 64)
CNN_BATCH_SIZES = (1, 8, 32)

SCALE4_MLIR = """\
module @scale4 {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""

SOFTMAX_MODEL_PY = '''\
"""mlp_softmax: the demo mlp whose postprocess turns its logits into probabilities.

The executable output ``output`` f32 [B, 8] becomes the client output ``probs`` f32 [B, 8].
``register_model`` is injected by the worker when it runs this file.
"""

import dataclasses

import numpy as np


def postprocess(outputs):
    (logits,) = [t for t in outputs if t.name == "output"]
    z = logits.data.astype(np.float32)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    probs = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    # same dtype (f32) and shape as the logits: only the name and the numbers change
    return [dataclasses.replace(logits, name="probs", data=probs)]


register_model("mlp_softmax", postprocess=postprocess)  # noqa: F821 (injected)
'''

TOKENIZE_SUM_MODEL_PY = '''\
"""tokenize_sum: string tensors through hooks.

Client input ``text`` BYTES [B] (one string per row). preprocess splits each string on ASCII
whitespace and writes the byte length of each of its first 16 tokens into ``ids`` i32 [B, 16]
(0 = no token); the executable sums per row: ``tokens`` (how many) and ``token_bytes`` (their
bytes). postprocess keeps ``tokens`` and adds ``label`` BYTES [B]: "<n> tokens, <m> bytes".
``register_model`` is injected by the worker when it runs this file.
"""

import numpy as np

from kserve_trio.core.tensors import NamedTensor

MAX_TOKENS = 16


def preprocess(inputs):
    (text,) = [t for t in inputs if t.name == "text"]
    rows = text.data.reshape(-1)  # an object array of bytes
    ids = np.zeros((len(rows), MAX_TOKENS), np.int32)
    for i, value in enumerate(rows):
        lengths = [len(token) for token in value.split()][:MAX_TOKENS]
        ids[i, : len(lengths)] = lengths
    return [NamedTensor.from_array("ids", ids)]


def postprocess(outputs):
    by_name = {t.name: t for t in outputs}
    tokens = by_name["tokens"].data
    nbytes = by_name["token_bytes"].data
    label = np.array([f"{n} tokens, {m} bytes" for n, m in zip(tokens, nbytes)], dtype=object)
    return [by_name["tokens"], NamedTensor.from_array("label", label)]


register_model("tokenize_sum", preprocess=preprocess, postprocess=postprocess)  # noqa: F821
'''


# ----------------------------------------------------------------------------------------------
# weights and reference numerics
# ----------------------------------------------------------------------------------------------


def mlp_weights() -> dict[str, np.ndarray]:
    """``w1`` [16,64], ``b1`` [64], ``w2`` [64,8], ``b2`` [8], from ``default_rng(0)``."""
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((16, 64)) / 4.0).astype(np.float32),
        "b1": (rng.standard_normal(64) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((64, 8)) / 8.0).astype(np.float32),
        "b2": (rng.standard_normal(8) * 0.1).astype(np.float32),
    }


def cnn_weights() -> dict[str, np.ndarray]:
    """``conv_w`` [8,3,3,3] (OIHW), ``conv_b`` [8], ``fc_w`` [8,10], ``fc_b`` [10]."""
    rng = np.random.default_rng(0)
    return {
        "conv_w": (rng.standard_normal((8, 3, 3, 3)) / np.sqrt(27.0)).astype(np.float32),
        "conv_b": (rng.standard_normal(8) * 0.1).astype(np.float32),
        "fc_w": (rng.standard_normal((8, 10)) / np.sqrt(8.0)).astype(np.float32),
        "fc_b": (rng.standard_normal(10) * 0.1).astype(np.float32),
    }


def mlp_reference(x: np.ndarray, w: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """``relu(x @ w1 + b1) @ w2 + b2`` in float32 numpy."""
    w = w or mlp_weights()
    h = np.maximum(x.astype(np.float32) @ w["w1"] + w["b1"], 0.0)
    return (h @ w["w2"] + w["b2"]).astype(np.float32)


def cnn_reference(x: np.ndarray, w: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """3x3 SAME convolution (NCHW, OIHW) + bias, relu, global mean pool, dense, in numpy."""
    w = w or cnn_weights()
    x = x.astype(np.float32)
    _, _, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    # patches[b, c, dy, dx, h, w]
    patches = np.stack(
        [np.stack([xp[:, :, dy : dy + h, dx : dx + wd] for dx in range(3)], 2) for dy in range(3)],
        2,
    )
    y = np.einsum("bcyxhw,ocyx->bohw", patches, w["conv_w"]) + w["conv_b"][None, :, None, None]
    pooled = np.maximum(y, 0.0).mean(axis=(2, 3))
    return (pooled @ w["fc_w"] + w["fc_b"]).astype(np.float32)


def softmax_reference(x: np.ndarray) -> np.ndarray:
    """The ``mlp_softmax`` client output for input ``x``."""
    z = mlp_reference(x)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def tokenize_sum_reference(texts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``tokenize_sum``'s client outputs for an object array of byte strings: the token counts
    (i32) and the labels (an object array of ``bytes``)."""
    tokens, labels = [], []
    for value in np.asarray(texts, dtype=object).reshape(-1):
        lengths = [len(token) for token in bytes(value).split()][:MAX_TOKENS]
        tokens.append(len(lengths))
        labels.append(f"{len(lengths)} tokens, {sum(lengths)} bytes".encode())
    return np.array(tokens, np.int32), np.array(labels, dtype=object)


# ----------------------------------------------------------------------------------------------
# the jax functions
# ----------------------------------------------------------------------------------------------


def mlp_fn(x, w1, b1, w2, b2):
    import jax.numpy as jnp

    return jnp.maximum(x @ w1 + b1, 0) @ w2 + b2


def cnn_fn(x, conv_w, conv_b, fc_w, fc_b):
    import jax
    import jax.numpy as jnp

    y = jax.lax.conv_general_dilated(
        x, conv_w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    y = jnp.maximum(y + conv_b[None, :, None, None], 0)
    return y.mean(axis=(2, 3)) @ fc_w + fc_b


def tokenize_sum_fn(ids):
    import jax.numpy as jnp

    return jnp.sum(ids > 0, axis=1, dtype=jnp.int32), jnp.sum(ids, axis=1, dtype=jnp.int32)


# ----------------------------------------------------------------------------------------------
# writers
# ----------------------------------------------------------------------------------------------


def write_mlp(d: Path) -> Path:
    x = np.zeros((1, 16), np.float32)
    return export_bundle("jax", mlp_fn, x, mlp_weights(), dir=d, batch_sizes=list(MLP_BATCH_SIZES))


def write_cnn(d: Path) -> Path:
    x = np.zeros((1, 3, 32, 32), np.float32)
    return export_bundle("jax", cnn_fn, x, cnn_weights(), dir=d, batch_sizes=list(CNN_BATCH_SIZES))


def write_scale4(d: Path) -> Path:
    spec_x = IOSpec("x", "f32", (4,), letters=("c",))
    spec_y = IOSpec("y", "f32", (4,), letters=("c",))
    return write_bundle(
        d,
        executable_inputs=[spec_x],
        executable_outputs=[spec_y],
        modules={0: SCALE4_MLIR},
        weights=[("w", np.full(4, 2.0, np.float32))],
        compiled_batch_sizes=[1],
        provenance={
            "source_framework": "stablehlo",
            "converter": "hand-written (upstream fixture)",
        },
    )


def write_mlp_bf16(d: Path) -> Path:
    w = {k: v.astype(ml_dtypes.bfloat16) for k, v in mlp_weights().items()}
    x = np.zeros((1, 16), ml_dtypes.bfloat16)
    return export_bundle("jax", mlp_fn, x, w, dir=d, batch_sizes=list(MLP_BATCH_SIZES))


def write_mlp_softmax(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / MODEL_PY).write_text(SOFTMAX_MODEL_PY)  # before the manifest that needs it
    x = np.zeros((1, 16), np.float32)
    return export_bundle(
        "jax",
        mlp_fn,
        x,
        mlp_weights(),
        dir=d,
        batch_sizes=list(MLP_BATCH_SIZES),
        client_outputs=[IOSpec("probs", "f32", (1, 8), batch_axis=0)],
    )


def write_tokenize_sum(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / MODEL_PY).write_text(TOKENIZE_SUM_MODEL_PY)  # before the manifest that needs it
    return export_bundle(
        "jax",
        tokenize_sum_fn,
        np.zeros((1, MAX_TOKENS), np.int32),
        dir=d,
        batch_sizes=list(TOKENIZE_BATCH_SIZES),
        input_names=["ids"],
        output_names=["tokens", "token_bytes"],
        client_inputs=[IOSpec("text", "bytes", (1,), batch_axis=0)],
        client_outputs=[
            IOSpec("tokens", "i32", (1,), batch_axis=0),
            IOSpec("label", "bytes", (1,), batch_axis=0),
        ],
    )


WRITERS: dict[str, Callable[[Path], Path]] = {
    "mlp": write_mlp,
    "cnn": write_cnn,
    "scale4": write_scale4,
    "mlp_bf16": write_mlp_bf16,
    "mlp_softmax": write_mlp_softmax,
    "tokenize_sum": write_tokenize_sum,
}


def write_demo_repository(
    root: str | os.PathLike[str], *, only: Iterable[str] | None = None
) -> dict[str, Path]:
    """Write the demo bundles (``DEMO_MODELS``, or the names in ``only``, which may name
    ``EXTRA_DEMO_MODELS`` too) under ``root``; returns their dirs."""
    names = list(only) if only is not None else list(DEMO_MODELS)
    unknown = [n for n in names if n not in WRITERS]
    if unknown:
        known = ", ".join((*DEMO_MODELS, *EXTRA_DEMO_MODELS))
        raise ValueError(f"unknown demo model(s) {unknown}; available: {known}")
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    return {n: WRITERS[n](r / n) for n in names}


__all__ = [
    "DEMO_MODELS",
    "EXTRA_DEMO_MODELS",
    "SCALE4_MLIR",
    "cnn_reference",
    "cnn_weights",
    "mlp_reference",
    "mlp_weights",
    "softmax_reference",
    "tokenize_sum_reference",
    "write_demo_repository",
]
