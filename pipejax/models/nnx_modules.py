"""The zoo's layers written in Flax NNX, the twins of the linen ones.

`pj.models.*(..., api="nnx", inputs=..., rngs=...)` builds its list from
these (models/builder.py); the architecture (which block where, widths,
strides) is written once in each model's own file, for both APIs. Each class
has its linen twin's name, parameter shapes and initializers, and computes
the same function; unlike linen, it takes its input features when built.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from pipejax.models.common import (COLUMNS, GPT_INIT, ROWS, VECTOR, alpha_dropout, causal_mask,
                                   fused, global_avg_pool, patches, positions, residual_init,
                                   with_segments)


class Conv(nnx.Module):
    """The zoo's `Conv` (a 'SAME' convolution as one product of the input's
    windows, models/common.py) in NNX: `nnx.Conv`'s parameters and result."""

    def __init__(self, in_features: int, features: int, kernel_size: Sequence[int],
                 strides: Sequence[int] | int = 1, use_bias: bool = True, *, rngs: nnx.Rngs):
        self.window = tuple(kernel_size)
        self.strides = (strides,) * len(self.window) if isinstance(strides, int) else tuple(strides)
        self.kernel = nnx.Param(nn.initializers.lecun_normal()(
            rngs.params(), (*self.window, in_features, features)))
        self.bias = nnx.Param(jnp.zeros((features,))) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        y = patches(x, self.window, self.strides) @ kernel.reshape(-1, kernel.shape[-1])
        return y if self.bias is None else y + self.bias[...]


class MaxPool(nnx.Module):
    """Max pooling by 2 over the spatial axes (1-D or 2-D); no parameters."""

    def __init__(self, dims: int = 1):
        self.dims = dims

    def __call__(self, x):
        return nn.max_pool(x, (2,) * self.dims, strides=(2,) * self.dims)


class AlphaDropout(nnx.Module):
    """Dropout that keeps SELU's zero mean and unit variance (Klambauer et
    al. 2017); `.eval()` turns it off, as `nnx.Dropout`."""

    def __init__(self, rate: float, *, rngs: nnx.Rngs, deterministic: bool = False):
        self.rate, self.deterministic = rate, deterministic
        self.rngs = rngs["dropout"].fork()

    def __call__(self, x):
        if self.deterministic or self.rate == 0.0:
            return x
        return alpha_dropout(x, self.rate, self.rngs())


class ConvBlock(nnx.Module):
    """relu(gn(conv(x))), or relu(conv(x)) without `groups` (VGG)."""

    def __init__(self, in_features: int, features: int, groups: int | None = None,
                 dims: int = 1, *, rngs: nnx.Rngs):
        self.conv = Conv(in_features, features, (3,) * dims, rngs=rngs)
        self.norm = nnx.GroupNorm(features, num_groups=groups, rngs=rngs) if groups else None

    def __call__(self, x):
        h = self.conv(x)
        return nn.relu(h if self.norm is None else self.norm(h))


class _PreActConv(nnx.Module):
    """conv(relu(gn(x))), and relu(gn(x)) for a projection shortcut."""

    def __init__(self, in_features: int, features: int, groups: int, dims: int,
                 strides: int = 1, *, rngs: nnx.Rngs):
        self.norm = nnx.GroupNorm(in_features, num_groups=groups, rngs=rngs)
        self.conv = Conv(in_features, features, (3,) * dims, strides, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = nn.relu(self.norm(x))
        return self.conv(h), h


def _projection(in_features: int, features: int, strides: int, dims: int,
                rngs: nnx.Rngs) -> Conv | None:
    """A 1×1 projection of the shortcut when the shape changes, else None."""
    if strides == 1 and in_features == features:
        return None
    return Conv(in_features, features, (1,) * dims, strides, use_bias=False, rngs=rngs)


class PreActBlock(nnx.Module):
    """x + conv(relu(gn(conv(relu(gn(x)))))); a 1×1 projection when the shape changes."""

    def __init__(self, in_features: int, features: int, groups: int = 8, strides: int = 1,
                 dims: int = 1, *, rngs: nnx.Rngs):
        self.first = _PreActConv(in_features, features, groups, dims, strides, rngs=rngs)
        self.project = _projection(in_features, features, strides, dims, rngs)
        self.second = _PreActConv(features, features, groups, dims, rngs=rngs)

    def __call__(self, x):
        h, pre = self.first(x)
        return self.second(h)[0] + (x if self.project is None else self.project(pre))


class ResidualFork(nnx.Module):
    """A block's first pre-activation convolution: x -> (branch, shortcut)."""

    def __init__(self, in_features: int, features: int, groups: int = 8, strides: int = 1,
                 dims: int = 1, *, rngs: nnx.Rngs):
        self.conv = _PreActConv(in_features, features, groups, dims, strides, rngs=rngs)
        self.project = _projection(in_features, features, strides, dims, rngs)

    def __call__(self, x):
        h, pre = self.conv(x)
        return h, (x if self.project is None else self.project(pre))


class ResidualConv(nnx.Module):
    """A block's second pre-activation convolution, on the branch: (h, s) -> (conv(h), s)."""

    def __init__(self, features: int, groups: int = 8, dims: int = 1, *, rngs: nnx.Rngs):
        self.conv = _PreActConv(features, features, groups, dims, rngs=rngs)

    def __call__(self, x):
        h, shortcut = x
        return self.conv(h)[0], shortcut


class Head(nnx.Module):
    """[GroupNorm, ReLU,] global average pooling, Linear classifier (ResNet, LSTM)."""

    def __init__(self, in_features: int, classes: int, groups: int | None = None, *,
                 rngs: nnx.Rngs):
        self.norm = nnx.GroupNorm(in_features, num_groups=groups, rngs=rngs) if groups else None
        self.linear = nnx.Linear(in_features, classes, rngs=rngs)

    def __call__(self, x):
        return self.linear(global_avg_pool(x if self.norm is None else nn.relu(self.norm(x))))


class Patches(nnx.Module):
    """[B, L] signal -> [B, L / size, size] sequence of patches."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, x):
        return x.reshape(x.shape[0], x.shape[1] // self.size, self.size)


class Embed(nnx.Module):
    """Linear embedding of each position plus a learned positional embedding."""

    def __init__(self, length: int, in_features: int, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(in_features, dim, rngs=rngs)
        self.position = nnx.Param(nn.initializers.normal(0.02)(rngs.params(), (length, dim)))

    def __call__(self, x):
        return self.linear(x) + self.position[...][None]


class EncoderBlock(nnx.Module):
    """x + MHA(LN(x)), then x + MLP(LN(x)); dropout in the attention and after the MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2, dropout: float = 0.0, *,
                 rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, dim, dropout_rate=dropout, decode=False,
                                                deterministic=False,
                                                keep_rngs=dropout > 0, rngs=rngs)
        self.up = nnx.Linear(dim, dim * mlp_ratio, rngs=rngs)
        self.down = nnx.Linear(dim * mlp_ratio, dim, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

    def __call__(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h)
        h = self.down(nn.gelu(self.up(self.norm2(x))))
        return x + (h if self.dropout is None else self.dropout(h))


class Classifier(nnx.Module):
    """LayerNorm, mean over the sequence, Linear."""

    def __init__(self, dim: int, classes: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.linear = nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x):
        return self.linear(global_avg_pool(self.norm(x)))


class ResidualLSTM(nnx.Module):
    """x + LSTM(x) over a sequence [B, T, hidden]; the carry starts at zeros
    (no random stream: the layer draws no random numbers)."""

    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = hidden
        self.rnn = nnx.RNN(nnx.LSTMCell(hidden, hidden, rngs=rngs), rngs=False)

    def __call__(self, x):
        zeros = jnp.zeros((x.shape[0], self.hidden), x.dtype)
        return x + self.rnn(x, initial_carry=(zeros, zeros))


class TokenEmbed(nnx.Module):
    """Token embedding plus a learned position embedding of the first T positions."""

    def __init__(self, vocab: int, width: int, context: int, dropout: float = 0.0,
                 embed: nnx.Embed | None = None, *, rngs: nnx.Rngs):
        if embed is None:
            self.token = nnx.Embed(vocab, width, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(GPT_INIT, ROWS))
        else:  # shared with the head (tied), named as the linen twin's field
            self.embed = embed
        self.position = nnx.Param(GPT_INIT(rngs.params(), (context, width)))
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
        self.index: nnx.Cache | None = nnx.data(None)  # positions decoded so far

    def init_cache(self, input_shape: tuple, dtype=None) -> None:
        """Decode from the first position (`pj.generate`)."""
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))

    def __call__(self, tokens, decode: bool = False):
        tokens, segments = with_segments(tokens)
        h = (self.embed if hasattr(self, "embed") else self.token)(tokens)
        if decode:  # the next positions, after those decoded so far
            at = self.index[...]
            self.index[...] = at + h.shape[1]
            h = h + jax.lax.dynamic_slice_in_dim(self.position[...], at, h.shape[1])[None]
        else:
            h = h + positions(self.position[...], segments, h)
        h = h if self.dropout is None else self.dropout(h)
        return h if segments is None else (h, segments)


class CausalBlock(nnx.Module):
    """x + Dropout(CausalSelfAttention(LN(x))), then x + Dropout(MLP(LN(x)))."""

    def __init__(self, width: int, heads: int, depth: int, dropout: float = 0.0, *,
                 rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
        split = nnx.with_partitioning
        self.attention = nnx.MultiHeadAttention(
            heads, width, use_bias=False, kernel_init=split(GPT_INIT, COLUMNS),
            out_kernel_init=split(residual_init(depth), ROWS), dropout_rate=dropout,
            decode=False, deterministic=False, keep_rngs=dropout > 0,
            attention_fn=fused(nnx.dot_product_attention), rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, kernel_init=split(GPT_INIT, COLUMNS),
                             bias_init=split(nn.initializers.zeros, VECTOR), rngs=rngs)
        self.down = nnx.Linear(4 * width, width, kernel_init=split(residual_init(depth), ROWS),
                               rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

    def init_cache(self, input_shape: tuple, dtype=jnp.float32) -> None:
        """Keys and values of a window of `input_shape` (`pj.generate`)."""
        self.attention.init_cache(input_shape, dtype)

    def __call__(self, x, decode: bool = False):
        x, segments = with_segments(x)
        drop = (lambda h: h) if self.dropout is None else self.dropout
        h = self.norm1(x)
        x = x + drop(self.attention(h, h, mask=causal_mask(x, segments), decode=decode))
        x = x + drop(self.down(nn.gelu(self.up(self.norm2(x)))))
        return x if segments is None else (x, segments)


class LMHead(nnx.Module):
    """Final LayerNorm and a linear map to the vocabulary's logits (no bias)."""

    def __init__(self, width: int, vocab: int, embed: nnx.Embed | None = None, *,
                 rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        if embed is None:
            self.logits = nnx.Linear(width, vocab, use_bias=False, rngs=rngs,
                                     kernel_init=nnx.with_partitioning(GPT_INIT, COLUMNS))
        else:  # the token embedding's transpose (tied)
            self.embed = embed

    def init_cache(self, input_shape: tuple, dtype=None) -> None:
        """Nothing to keep: each position alone."""

    def __call__(self, x, decode: bool = False):
        x, _ = with_segments(x)
        x = self.norm(x)
        return self.embed.attend(x) if hasattr(self, "embed") else self.logits(x)
