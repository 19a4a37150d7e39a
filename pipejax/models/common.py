"""Small named layers that the model lists share (names show in `pipe.plan`)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


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
