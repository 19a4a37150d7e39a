"""Stacked LSTMs with residual connections (Wu et al. 2016, GNMT), a SpecTrain
model: each layer is x + LSTM(x), a Flax `nn.RNN` over `nn.LSTMCell`."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
from flax import nnx

from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
from pipejax.models.common import add_channel, global_avg_pool


class ResidualLSTM(nn.Module):
    """x + LSTM(x) over a sequence [B, T, hidden]."""

    hidden: int

    @nn.compact
    def __call__(self, x):
        return x + nn.RNN(nn.LSTMCell(self.hidden))(x)


class Head(nn.Module):
    """Mean over time, Dense classifier."""

    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(global_avg_pool(x))


def residual_lstm(layers: int = 3, hidden: int = 64, classes: int = 10, *, api: str = "linen",
                  inputs: int | Sequence[int] | None = None,
                  rngs: nnx.Rngs | None = None) -> list:
    """Signals [B, L] as sequences of L samples: Dense to `hidden`, `layers`
    residual LSTM layers, mean over time, Dense(classes); `api="nnx"` builds
    NNX modules for `inputs` (models/builder.py)."""
    b = Builder("residual_lstm", api, inputs, rngs).add(add_channel)
    b.add(nn.Dense(hidden), lambda f, r: nnx.Linear(f, hidden, rngs=r))
    for _ in range(layers):
        b.add(ResidualLSTM(hidden), lambda f, r: nnx_modules.ResidualLSTM(hidden, rngs=r))
    return b.add(Head(classes), lambda f, r: nnx_modules.Head(f, classes, rngs=r)).layers
