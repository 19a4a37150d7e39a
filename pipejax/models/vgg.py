"""VGG-style networks (Simonyan & Zisserman 2015): stacks of 3-wide convolutions
and ReLU, max pooling between stacks, then Dense layers."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from pipejax.models.common import MaxPool, add_channel, flatten


def vgg(config: Sequence[int | str] = (16, 16, "M", 32, 32, "M", 64, "M"), classes: int = 10,
        dims: int = 1, dense: int = 128) -> list:
    """`config`: channel counts of the convolutions, "M" for a max pooling by 2.
    `dims=1` takes signals [B, L]; `dims=2` takes images [B, H, W, C]."""
    layers: list = [add_channel] if dims == 1 else []
    for item in config:
        if item == "M":
            layers.append(MaxPool(dims))
        else:
            layers += [nn.Conv(int(item), (3,) * dims), nn.relu]
    layers += [flatten, nn.Dense(dense), nn.relu, nn.Dense(classes)]
    return layers
