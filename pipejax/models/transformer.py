"""A pre-LayerNorm Transformer encoder classifier (Vaswani et al. 2017) over a
sequence: patches of a signal (or tokens) are embedded, pass `layers` encoder
blocks (one block is one layer), are mean-pooled and classified."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
from flax import nnx

from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
from pipejax.models.common import global_avg_pool


class Patches(nn.Module):
    """[B, L] signal -> [B, L / size, size] sequence of patches."""

    size: int

    def __call__(self, x):
        return x.reshape(x.shape[0], x.shape[1] // self.size, self.size)


class Embed(nn.Module):
    """Dense embedding of each position plus a learned positional embedding."""

    dim: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.dim)(x)
        pos = self.param("position", nn.initializers.normal(0.02), (x.shape[1], self.dim))
        return h + pos[None]


class EncoderBlock(nn.Module):
    """x + MHA(LN(x)), then x + MLP(LN(x))."""

    dim: int
    heads: int
    mlp_ratio: int = 2
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dropout_rate=self.dropout,
                                            deterministic=deterministic)(h, h)
        x = x + h
        h = nn.Dense(self.dim * self.mlp_ratio)(nn.LayerNorm()(x))
        h = nn.Dense(self.dim)(nn.gelu(h))
        return x + nn.Dropout(self.dropout, deterministic=deterministic)(h)


class Classifier(nn.Module):
    """LayerNorm, mean over the sequence, Dense."""

    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(global_avg_pool(nn.LayerNorm()(x)))


def transformer(layers: int = 4, dim: int = 64, heads: int = 4, classes: int = 10,
                patch: int = 4, dropout: float = 0.0, *, api: str = "linen",
                inputs: int | Sequence[int] | None = None, rngs: nnx.Rngs | None = None) -> list:
    """Signals [B, L] cut into L / `patch` patches of `patch` samples;
    `api="nnx"` builds NNX modules for `inputs` (models/builder.py)."""
    N = nnx_modules
    b = Builder("transformer", api, inputs, rngs).add(Patches(patch), lambda f, r: N.Patches(patch))
    b.add(Embed(dim), lambda f, r: N.Embed(b.shape[0], f, dim, rngs=r))
    for _ in range(layers):
        b.add(EncoderBlock(dim, heads, dropout=dropout),
              lambda f, r: N.EncoderBlock(dim, heads, dropout=dropout, rngs=r))
    return b.add(Classifier(classes), lambda f, r: N.Classifier(f, classes, rngs=r)).layers
