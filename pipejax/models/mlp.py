"""Multi-layer perceptron as a layer list: [Dense, activation] × depth, then Dense."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn


def mlp(depth: int = 4, width: int = 256, classes: int = 10,
        activation: Callable = nn.relu, dropout: float = 0.0) -> list:
    """`depth` hidden Dense layers of `width`, each followed by `activation`
    (and Dropout if `dropout` > 0), then a Dense classifier of `classes` outputs."""
    layers: list = []
    for _ in range(depth):
        layers += [nn.Dense(width), activation]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Dense(classes))
    return layers
