"""Small named layers that the model lists share (names show in `pipe.plan`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipejax.errors import LayerError


GPT_INIT = nn.initializers.normal(0.02)  # GPT-2's weights: N(0, 0.02²)
SELU_DROP = -1.7580993408473766  # −λ·α of SELU: the value AlphaDropout drops to


def alpha_dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Dropout that keeps SELU's zero mean and unit variance (Klambauer et al.
    2017): dropped units take SELU's saturation value, then an affine map
    restores the moments."""
    keep = 1.0 - rate
    a = (keep * (1 + rate * SELU_DROP ** 2)) ** -0.5
    b = -a * SELU_DROP * rate
    return a * jnp.where(jax.random.bernoulli(key, keep, x.shape), x, SELU_DROP) + b


# Megatron's layout of a Transformer over the mesh axis "tensor" (Shoeybi et
# al. 2019, §3): the first matrix of the MLP split by columns, the second by
# rows; attention split by heads (query, key, value by their output heads,
# the output projection by its input heads); embedding and head split over
# the vocabulary. One all-reduce per split pair, inserted by XLA. Flax calls
# an attention kernel's init with its flat (in, out) shape, so COLUMNS on a
# query kernel (in, heads, head_dim) splits its heads, ROWS on the output
# kernel (heads, head_dim, out) too.
COLUMNS = (None, "tensor")  # a Dense kernel (in, out) split over its outputs
ROWS = ("tensor", None)  # split over its inputs (or an embedding over the vocabulary)
VECTOR = ("tensor",)  # the bias of a column-split Dense


def residual_init(depth: int) -> nn.initializers.Initializer:
    """N(0, 0.02²/(2·depth)) for the projections that write into a GPT's
    residual stream (Radford et al. 2019, §2.3: scaled by 1/√N, N residual layers)."""
    return nn.initializers.normal(0.02 / math.sqrt(2 * depth))


def causal_mask(x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """[B, T, ...] -> a [B, 1, T, T] mask: position t attends to positions ≤ t,
    and with document ids `segments` [B, T] only to those of its own document."""
    causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.bool_))
    if segments is None:
        return causal
    return nn.combine_masks(causal, nn.make_attention_mask(segments, segments, jnp.equal))


def fused(fallback: Callable) -> Callable:
    """An `attention_fn` for Flax's attention modules (linen's and NNX's;
    `fallback` their own `dot_product_attention`) that runs the softmax
    attention as one `jax.nn.dot_product_attention`: JAX picks cuDNN's fused
    kernel on a GPU and XLA's attention on a CPU, where it equals Flax's
    einsum, softmax and einsum within 1e-6 (tests/models/test_gpt.py).
    Dropout on the attention weights, which the fused call has not, runs
    `fallback`; so do a bias and a `dtype` other than the inputs'."""

    # Flax passes only the keywords this signature names.
    def attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                  dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                  precision=None, **rest):
        same = jnp.result_type(query, key, value)
        if (dropout_rate > 0.0 and not deterministic) or bias is not None or (
                dtype is not None and jnp.dtype(dtype) != same):
            return fallback(query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
                            dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                            deterministic=deterministic, dtype=dtype, precision=precision,
                            **rest)
        cast = lambda a: a.astype(same)
        mask = None if mask is None else mask.astype(jnp.bool_)  # Flax's masks come as 0/1 floats
        return jax.nn.dot_product_attention(cast(query), cast(key), cast(value), mask=mask)

    return attention


def with_segments(x: Any) -> tuple[jax.Array, jax.Array | None]:
    """A language-model layer's input as (activations or tokens, document
    ids or None): packed rows travel as a pair `(x, segments)`."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise LayerError(f"a packed input is a pair (tokens or activations, segment ids), "
                             f"not {len(x)} arrays")
        return x[0], x[1]
    return x, None


def document_positions(segments: jax.Array) -> jax.Array:
    """[B, T] document ids -> each position's index within its document
    (0 where a new id starts), the positions a document alone would have."""
    index = jnp.arange(segments.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segments[:, :1], jnp.bool_),
                              segments[:, 1:] != segments[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def positions(table: jax.Array, segments: jax.Array | None, h: jax.Array) -> jax.Array:
    """Learned position embeddings (`table` [context, width]) of `h`'s
    positions [B, T, width]: the first T rows, or with document ids each
    token's row within its document."""
    if segments is None:
        return table[:h.shape[1]][None].astype(h.dtype)
    return table[document_positions(segments)].astype(h.dtype)


def add_channel(x: jax.Array) -> jax.Array:
    """[B, L] signal -> [B, L, 1], the layout of a 1-D convolution."""
    return x[..., None]


def flatten(x: jax.Array) -> jax.Array:
    """[B, ...] -> [B, features]."""
    return x.reshape(x.shape[0], -1)


def global_avg_pool(x: jax.Array) -> jax.Array:
    """Mean over every axis but the batch and the channels."""
    return jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))


class MaxPool(nn.Module):
    """Max pooling by 2 over the spatial axes (1-D or 2-D); no parameters."""

    dims: int = 1

    def __call__(self, x):
        return nn.max_pool(x, (2,) * self.dims, strides=(2,) * self.dims)


def patches(x: jax.Array, window: Sequence[int], strides: Sequence[int]) -> jax.Array:
    """[B, *spatial, C] -> [B, *out, prod(window)·C]: every window of a 'SAME'
    convolution, window offsets major and channels minor (the order of a
    kernel [*window, C, F] reshaped to [prod(window)·C, F])."""
    spatial = x.shape[1:-1]
    out = [-(-n // s) for n, s in zip(spatial, strides)]
    pads = [max((o - 1) * s + w - n, 0) for o, s, w, n in zip(out, strides, window, spatial)]
    x = jnp.pad(x, [(0, 0), *[(p // 2, p - p // 2) for p in pads], (0, 0)])
    offsets = np.indices(window).reshape(len(window), -1).T.tolist()
    views = [x[(slice(None), *[slice(i, i + (o - 1) * s + 1, s)
                               for i, o, s in zip(at, out, strides)])] for at in offsets]
    return jnp.concatenate(views, axis=-1)


class Conv(nn.Module):
    """`nn.Conv` with 'SAME' padding: the same parameters (names, shapes,
    initializers) and the same result, computed as one matrix product of the
    input's windows. XLA's CPU convolution of the zoo's small signals and
    images runs 2–4× slower than that product (a 16-channel 1-D convolution
    of length 40, forward and backward: 45 µs against 19 µs at batch 1,
    374 µs against 103 µs at batch 8), and micro-batch-1 pipelines run tens
    of thousands of them."""

    features: int
    kernel_size: Sequence[int]
    strides: Sequence[int] | int = 1
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        window = tuple(self.kernel_size)
        strides = ((self.strides,) * len(window) if isinstance(self.strides, int)
                   else tuple(self.strides))
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (*window, x.shape[-1], self.features))
        y = patches(x, window, strides) @ kernel.reshape(-1, self.features)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return y
