"""Small PyTorch models for the torch export tests (unit and end-to-end), each a factory that
returns the module in eval mode with fixed seeded weights, as ``bundle export-torch`` expects.

Importing this module imports torch; only the torch tests import it.
"""

from __future__ import annotations

import torch
from torch import nn


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Conv, BatchNorm (eval: running statistics), ReLU, max and average pooling, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        y = nn.functional.adaptive_avg_pool2d(y, 4)
        return self.fc(y.flatten(1)) * 0.5 + 1.0


class MultiIO(nn.Module):
    """Two inputs, three outputs: logits, their argmax (int64) and a per-row sum."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = torch.tanh(self.a(x) + self.b(y))
        logits = self.head(h)
        return logits, logits.argmax(-1), (x.sum(-1) - y.sum(-1))


class Tokens(nn.Module):
    """A per-token model for shape variants: [n, L, 8] -> [n, L, 4] for several lengths L."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)) + x.mean(1, keepdim=True)[..., :4]


def mlp() -> nn.Module:
    _seeded(0)
    return MLP().eval()


def cnn() -> nn.Module:
    _seeded(1)
    m = CNN()
    with torch.no_grad():  # non-trivial running statistics, as after training
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.2, 0.2)
    return m.eval()


def encoder() -> nn.Module:
    """A tiny transformer encoder layer: attention, LayerNorm, GELU (dropout off in eval)."""
    _seeded(2)
    return nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.1, activation="gelu", batch_first=True
    ).eval()


def multi_io() -> nn.Module:
    _seeded(3)
    return MultiIO().eval()


def tokens() -> nn.Module:
    _seeded(4)
    return Tokens().eval()


def mlp_bf16() -> nn.Module:
    _seeded(5)
    return MLP().to(torch.bfloat16).eval()


def cnn_torchscript(path: str) -> str:
    """The ``cnn`` traced to TorchScript and saved at ``path`` (returns ``path``)."""
    m = cnn()
    torch.jit.trace(m, (torch.zeros(1, 3, 16, 16),)).save(path)
    return path
