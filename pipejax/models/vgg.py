"""VGG-style networks (Simonyan & Zisserman 2015): stacks of 3-wide convolutions
and ReLU, max pooling between stacks, then Dense layers. Each convolution with
its activation (and, with `groups`, its GroupNorm) is one layer, the unit
Kosson et al. (2020, §4) make one pipeline stage."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from pipejax.models.common import Conv, MaxPool, add_channel, flatten


class ConvBlock(nn.Module):
    """relu(gn(conv(x))), or relu(conv(x)) without `groups`."""

    features: int
    groups: int | None = None
    dims: int = 1

    @nn.compact
    def __call__(self, x):
        h = Conv(self.features, (3,) * self.dims)(x)
        if self.groups:
            h = nn.GroupNorm(num_groups=self.groups)(h)
        return nn.relu(h)


def vgg(config: Sequence[int | str] = (16, 16, "M", 32, 32, "M", 64, "M"), classes: int = 10,
        dims: int = 1, dense: int = 128, groups: int | None = None) -> list:
    """`config`: channel counts of the convolutions, "M" for a max pooling by 2.
    `dims=1` takes signals [B, L]; `dims=2` takes images [B, H, W, C].
    `groups`: normalize each convolution's output with a GroupNorm of that many
    groups (Wu & He 2018; what lets a VGG train at micro-batch size 1)."""
    layers: list = [add_channel] if dims == 1 else []
    for item in config:
        layers.append(MaxPool(dims) if item == "M" else ConvBlock(int(item), groups, dims))
    layers += [flatten, nn.Dense(dense), nn.relu, nn.Dense(classes)]
    return layers
