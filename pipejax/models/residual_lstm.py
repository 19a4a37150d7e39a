"""Stacked LSTMs with residual connections (Wu et al. 2016, GNMT), a SpecTrain
model: each layer is x + LSTM(x), a Flax `nn.RNN` over `nn.LSTMCell`."""

from __future__ import annotations

import flax.linen as nn

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


def residual_lstm(layers: int = 3, hidden: int = 64, classes: int = 10) -> list:
    """Signals [B, L] as sequences of L samples: Dense to `hidden`, `layers`
    residual LSTM layers, mean over time, Dense(classes)."""
    return [add_channel, nn.Dense(hidden)] + [ResidualLSTM(hidden) for _ in range(layers)] + \
        [Head(classes)]
