"""Pre-activation residual networks with GroupNorm (He et al. 2016; Wu & He 2018),
as used at micro-batch size 1 by pipelined backpropagation (Kosson et al. 2020):
GroupNorm needs no batch statistics, so every micro-batch size works. One
residual block is one layer, so the pipeline splits between blocks."""

from __future__ import annotations

import flax.linen as nn

from pipejax.models.common import add_channel, global_avg_pool


class PreActBlock(nn.Module):
    """x + conv(relu(gn(conv(relu(gn(x)))))); a 1×1 projection when the shape changes."""

    features: int
    groups: int = 8
    strides: int = 1
    dims: int = 1

    @nn.compact
    def __call__(self, x):
        kernel, strides = (3,) * self.dims, (self.strides,) * self.dims
        h = nn.relu(nn.GroupNorm(num_groups=self.groups)(x))
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = nn.Conv(self.features, (1,) * self.dims, strides, use_bias=False)(h)
        h = nn.Conv(self.features, kernel, strides, use_bias=False)(h)
        h = nn.relu(nn.GroupNorm(num_groups=self.groups)(h))
        h = nn.Conv(self.features, kernel, use_bias=False)(h)
        return h + shortcut


class Head(nn.Module):
    """GroupNorm, ReLU, global average pooling, Dense classifier."""

    classes: int
    groups: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(global_avg_pool(nn.relu(nn.GroupNorm(self.groups)(x))))


def resnet(depth: int = 6, width: int = 32, groups: int = 8, classes: int = 10,
           dims: int = 1) -> list:
    """A stem convolution, `depth` pre-activation blocks (width doubling and
    stride 2 at each third of the depth), and a head. `dims=1` takes signals
    [B, L]; `dims=2` takes images [B, H, W, C]."""
    layers: list = [add_channel] if dims == 1 else []
    layers.append(nn.Conv(width, (3,) * dims, use_bias=False))
    features = width
    for i in range(depth):
        down = i > 0 and i % max(1, depth // 3) == 0
        features = features * 2 if down else features
        layers.append(PreActBlock(features, groups, 2 if down else 1, dims))
    layers.append(Head(classes, groups))
    return layers
