"""Multi-layer perceptron as a layer list: [Dense, activation] × depth, then Dense."""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
from flax import nnx

from pipejax.models.builder import Builder


def mlp(depth: int = 4, width: int = 256, classes: int = 10,
        activation: Callable = nn.relu, dropout: float = 0.0, *, api: str = "linen",
        inputs: int | Sequence[int] | None = None, rngs: nnx.Rngs | None = None) -> list:
    """`depth` hidden Dense layers of `width`, each followed by `activation`
    (and Dropout if `dropout` > 0), then a Dense classifier of `classes` outputs.
    `api="nnx"` builds `nnx.Linear` / `nnx.Dropout` modules from `rngs`
    (default `nnx.Rngs(0)`) for `inputs` features (one example's shape)."""
    b = Builder("mlp", api, inputs, rngs)
    for _ in range(depth):
        b.add(nn.Dense(width), lambda f, r: nnx.Linear(f, width, rngs=r)).add(activation)
        if dropout > 0:
            b.add(nn.Dropout(dropout), lambda f, r: nnx.Dropout(dropout, rngs=r))
    return b.add(nn.Dense(classes), lambda f, r: nnx.Linear(f, classes, rngs=r)).layers
