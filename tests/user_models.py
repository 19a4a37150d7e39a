"""A researcher's own models and data, as `pipejax train --model
user_models:tiny_decoder` imports them: plain Flax linen modules, no pipejax."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np


class Embed(nn.Module):
    vocab: int
    context: int
    width: int

    @nn.compact
    def __call__(self, tokens):
        positions = self.param("positions", nn.initializers.normal(0.02),
                               (self.context, self.width))
        return nn.Embed(self.vocab, self.width)(tokens) + positions[:tokens.shape[-1]]


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, h):
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
        h = h + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(h), mask=mask)
        width = h.shape[-1]
        return h + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(h))))


class Head(nn.Module):
    vocab: int

    @nn.compact
    def __call__(self, h):
        return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def tiny_decoder(vocab: int, context: int, depth: int = 2, width: int = 16,
                 heads: int = 2) -> list:
    """A decoder-only language model over `vocab` tokens, `context` long."""
    return [Embed(vocab, context, width), *[Block(heads) for _ in range(depth)], Head(vocab)]


def flatten(x):
    return x.reshape(x.shape[0], -1)


def tiny_classifier(classes: int, inputs: tuple, width: int = 32) -> list:
    """An MLP over flattened examples of shape `inputs`."""
    return [flatten, nn.Dense(width), nn.relu, nn.Dense(classes)]


def not_a_model(width: int = 4) -> int:
    return width


def repeated_text():
    """A text corpus of a repeated verse (a `pj.data.Corpus`)."""
    import pipejax as pj

    verse = "Shall I compare thee to a summer's day?\n" * 400
    tokens = pj.data.encode(verse)
    return pj.data.Corpus(tokens[:12000], tokens[12000:], ("verse",), ("verse",))


def out_of_range_labels():
    """A classification set with a negative label (`pj.data.check` names it)."""
    import pipejax as pj

    x = np.zeros((8, 4), np.float32)
    return pj.data.Dataset(x, np.array([0, 1, -1, 1, 0, 1, 0, 1]), x, np.zeros(8, np.int32))
