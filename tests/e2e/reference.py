"""numpy references for the demo bundles, computed from the bundles' own weights files."""

from __future__ import annotations

import pathlib

import numpy as np
from safetensors.numpy import load_file


def weights(repo: pathlib.Path, model: str) -> dict[str, np.ndarray]:
    return load_file(str(repo / model / "weights.safetensors"))


def mlp(x: np.ndarray, w: dict) -> np.ndarray:
    h = np.maximum(x @ w["w1"] + w["b1"], 0.0)
    return h @ w["w2"] + w["b2"]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def cnn(x: np.ndarray, w: dict) -> np.ndarray:
    """conv3x3 (SAME, NCHW x OIHW) + relu + global mean pool + dense."""
    n, _c, h, wd = x.shape
    k = w["conv_w"]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    y = np.zeros((n, k.shape[0], h, wd), dtype=np.float64)
    for dh in range(3):
        for dw in range(3):
            y += np.einsum("nchw,oc->nohw", xp[:, :, dh : dh + h, dw : dw + wd], k[:, :, dh, dw])
    y = np.maximum(y + w["conv_b"][None, :, None, None], 0.0)
    pooled = y.mean(axis=(2, 3))
    return (pooled @ w["fc_w"] + w["fc_b"]).astype(np.float32)
