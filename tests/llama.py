"""A Llama-style decoder as a user writes it in NNX, no pipejax inside:
RMSNorm, rotary embeddings, SwiGLU, flat q/k/v kernels annotated with
Megatron's layout (`nnx.with_partitioning`) and reshaped into heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT = nnx.initializers.normal(0.02)
COLUMNS, ROWS = (None, "tensor"), ("tensor", None)


def _linear(n_in: int, n_out: int, names: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=nnx.with_partitioning(INIT, names),
                      rngs=rngs)


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of `[batch, T, heads, head_dim]`: each head's
    two halves rotated by position-dependent angles (Su et al. 2021)."""
    T, d = x.shape[1], x.shape[-1]
    angles = jnp.arange(T)[:, None] / 10000 ** (jnp.arange(d // 2) / (d // 2))
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    first, second = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], -1)


class Block(nnx.Module):
    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1, self.norm2 = nnx.RMSNorm(width, rngs=rngs), nnx.RMSNorm(width, rngs=rngs)
        self.q, self.k, self.v = (_linear(width, width, COLUMNS, rngs) for _ in range(3))
        self.o = _linear(width, width, ROWS, rngs)
        self.gate, self.up = (_linear(width, 2 * width, COLUMNS, rngs) for _ in range(2))
        self.down = _linear(2 * width, width, ROWS, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        B, T, W = h.shape
        heads = lambda a: a.reshape(B, T, self.heads, W // self.heads)
        x = self.norm1(h)
        q, k, v = rotary(heads(self.q(x))), rotary(heads(self.k(x))), heads(self.v(x))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(W // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e9)
        mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)
        h = h + self.o(mixed.reshape(B, T, W))
        x = self.norm2(h)
        return h + self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Embed(nnx.Module):
    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
        self.table = nnx.Embed(vocab, width, embedding_init=INIT, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.table(tokens)


class Head(nnx.Module):
    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
        self.norm, self.out = nnx.RMSNorm(width, rngs=rngs), _linear(width, vocab, COLUMNS, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.out(self.norm(h))


def decoder(vocab: int = 64, width: int = 32, heads: int = 2, depth: int = 2,
            seed: int = 0) -> list:
    """Embedding, `depth` blocks and the head, annotated, placed by the pipeline."""
    rngs = nnx.Rngs(seed)
    with nnx.use_eager_sharding(False):
        return [Embed(vocab, width, rngs), *(Block(width, heads, rngs) for _ in range(depth)),
                Head(vocab, width, rngs)]
