"""Pre-activation residual networks with GroupNorm (He et al. 2016; Wu & He 2018),
as used at micro-batch size 1 by pipelined backpropagation (Kosson et al. 2020):
GroupNorm needs no batch statistics, so every micro-batch size works.

One residual block is one layer, so the pipeline splits between blocks; with
`fine=True` each convolution (with its normalization and activation) is a
layer and the residual sum another, as Kosson et al. pipeline them (§4: "the
sum nodes between residual blocks also become pipeline stages"): inside a
block, layers pass the pair (branch, shortcut) on.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
from flax import nnx

from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
from pipejax.models.common import Conv, add_channel, global_avg_pool


def _preact_conv(x: jax.Array, features: int, groups: int, dims: int, strides: int = 1):
    """conv(relu(gn(x))), and relu(gn(x)) for a projection shortcut."""
    h = nn.relu(nn.GroupNorm(num_groups=groups)(x))
    return Conv(features, (3,) * dims, strides, use_bias=False)(h), h


def _shortcut(x: jax.Array, h: jax.Array, features: int, strides: int, dims: int) -> jax.Array:
    """x, or a 1×1 projection of the pre-activated h when the shape changes."""
    if strides == 1 and x.shape[-1] == features:
        return x
    return Conv(features, (1,) * dims, strides, use_bias=False)(h)


class PreActBlock(nn.Module):
    """x + conv(relu(gn(conv(relu(gn(x)))))); a 1×1 projection when the shape changes."""

    features: int
    groups: int = 8
    strides: int = 1
    dims: int = 1

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.GroupNorm(num_groups=self.groups)(x))
        shortcut = _shortcut(x, h, self.features, self.strides, self.dims)
        h = Conv(self.features, (3,) * self.dims, self.strides, use_bias=False)(h)
        h, _ = _preact_conv(h, self.features, self.groups, self.dims)
        return h + shortcut


class ResidualFork(nn.Module):
    """A block's first pre-activation convolution: x -> (branch, shortcut)."""

    features: int
    groups: int = 8
    strides: int = 1
    dims: int = 1

    @nn.compact
    def __call__(self, x):
        h, pre = _preact_conv(x, self.features, self.groups, self.dims, self.strides)
        return h, _shortcut(x, pre, self.features, self.strides, self.dims)


class ResidualConv(nn.Module):
    """A block's second pre-activation convolution, on the branch: (h, s) -> (conv(h), s)."""

    features: int
    groups: int = 8
    dims: int = 1

    @nn.compact
    def __call__(self, x):
        h, shortcut = x
        return _preact_conv(h, self.features, self.groups, self.dims)[0], shortcut


def residual_sum(x: tuple) -> jax.Array:
    """The sum node that closes a block: (branch, shortcut) -> branch + shortcut."""
    h, shortcut = x
    return h + shortcut


class Head(nn.Module):
    """GroupNorm, ReLU, global average pooling, Dense classifier."""

    classes: int
    groups: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(global_avg_pool(nn.relu(nn.GroupNorm(self.groups)(x))))


def resnet(depth: int = 6, width: int = 32, groups: int = 8, classes: int = 10,
           dims: int = 1, fine: bool = False, *, api: str = "linen",
           inputs: int | Sequence[int] | None = None, rngs: nnx.Rngs | None = None) -> list:
    """A stem convolution, `depth` pre-activation blocks (width doubling and
    stride 2 at each third of the depth), and a head. `dims=1` takes signals
    [B, L]; `dims=2` takes images [B, H, W, C]. `fine=True` makes each block
    three layers (two convolutions and the sum), as Kosson et al. pipeline it.
    `api="nnx"` builds NNX modules for `inputs` (models/builder.py)."""
    N = nnx_modules
    b = Builder("resnet", api, inputs, rngs)
    if dims == 1:
        b.add(add_channel)
    b.add(Conv(width, (3,) * dims, use_bias=False),
          lambda f, r: N.Conv(f, width, (3,) * dims, use_bias=False, rngs=r))
    features = width
    for i in range(depth):
        down = i > 0 and i % max(1, depth // 3) == 0
        features = features * 2 if down else features
        n, strides = features, 2 if down else 1
        if fine:
            b.add(ResidualFork(n, groups, strides, dims),
                  lambda f, r: N.ResidualFork(f, n, groups, strides, dims, rngs=r))
            b.add(ResidualConv(n, groups, dims), lambda f, r: N.ResidualConv(n, groups, dims, rngs=r))
            b.add(residual_sum)
        else:
            b.add(PreActBlock(n, groups, strides, dims),
                  lambda f, r: N.PreActBlock(f, n, groups, strides, dims, rngs=r))
    return b.add(Head(classes, groups), lambda f, r: N.Head(f, classes, groups, rngs=r)).layers
