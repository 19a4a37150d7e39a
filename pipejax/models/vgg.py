"""VGG-style networks (Simonyan & Zisserman 2015): stacks of 3-wide convolutions
and ReLU, max pooling between stacks, then Dense layers. Each convolution with
its activation (and, with `groups`, its GroupNorm) is one layer, the unit
Kosson et al. (2020, §4) make one pipeline stage."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
from flax import nnx

from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
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
        dims: int = 1, dense: int = 128, groups: int | None = None, *, api: str = "linen",
        inputs: int | Sequence[int] | None = None, rngs: nnx.Rngs | None = None) -> list:
    """`config`: channel counts of the convolutions, "M" for a max pooling by 2.
    `dims=1` takes signals [B, L]; `dims=2` takes images [B, H, W, C].
    `groups`: normalize each convolution's output with a GroupNorm of that many
    groups (Wu & He 2018; what lets a VGG train at micro-batch size 1).
    `api="nnx"` builds NNX modules for `inputs` (models/builder.py)."""
    b = Builder("vgg", api, inputs, rngs)
    if dims == 1:
        b.add(add_channel)
    for item in config:
        if item == "M":
            b.add(MaxPool(dims), lambda f, r: nnx_modules.MaxPool(dims))
        else:
            b.add(ConvBlock(int(item), groups, dims),
                  lambda f, r, n=int(item): nnx_modules.ConvBlock(f, n, groups, dims, rngs=r))
    b.add(flatten).add(nn.Dense(dense), lambda f, r: nnx.Linear(f, dense, rngs=r)).add(nn.relu)
    return b.add(nn.Dense(classes), lambda f, r: nnx.Linear(f, classes, rngs=r)).layers
