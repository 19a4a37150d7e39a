"""A decoder-only Transformer language model (GPT; Radford et al. 2019) as a
layer list: token + position embedding, `depth` pre-LayerNorm causal blocks
(one block is one layer), final LayerNorm and a linear head to the vocabulary.

Int tokens `[batch, T]` in (T ≤ `context`), logits `[batch, T, vocab]` out;
train with `pj.losses.next_token`. Packed rows of several documents come in
as a pair `(tokens, segments)` of document ids `[batch, T]`
(`pj.data.pack_documents`): each token then attends only to its own document
and takes its position within it, so a packed row computes what each
document alone would; the ids travel with the activations from layer to
layer. Attention projections have no biases, as
in most current language models: the key bias's gradient is zero in exact
arithmetic (softmax ignores a shift shared by every key), and Adam turns its
rounding noise into full-size steps. Weights are drawn from N(0, 0.02²), the
two residual projections of a block from N(0, 0.02²/(2·depth)) (GPT-2 §2.3).

The input embedding and the output head are separate matrices, or with
`tie_embeddings=True` one (GPT-2's): one `nn.Embed` held by `TokenEmbed` and
by `LMHead`, which multiplies by its transpose (`Embed.attend`); a pipeline
keeps a copy on each stage that holds one of them and sums their gradients
(pipejax/compile/ties.py).

The weights carry Megatron's layout for the mesh axis "tensor" as Flax
annotations (models/common.py: attention heads, the MLP's hidden axis, the
vocabulary axis of embedding and head): on a mesh with `tensor=T` each
stage's matrices are split over T devices; without one they are whole.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax
from flax import nnx

from pipejax.errors import ConfigError
from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
from pipejax.models.common import (COLUMNS, ROWS, VECTOR, GPT_INIT as INIT,
                                   causal_mask, fused, positions, residual_init, with_segments)


class TokenEmbed(nn.Module):
    """Token embedding plus a learned position embedding of the first T
    positions; with `decode`, of the positions after those it has seen."""

    vocab: int
    width: int
    context: int
    dropout: float = 0.0
    decode: bool = False  # Flax's decode mode: count the positions in the 'cache' collection
    embed: nn.Module | None = None  # a token embedding shared with the head (tied)

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        tokens, segments = with_segments(tokens)
        token = self.embed if self.embed is not None else nn.Embed(
            self.vocab, self.width, embedding_init=nn.with_partitioning(INIT, ROWS), name="token")
        h = token(tokens)
        position = self.param("position", INIT, (self.context, self.width))
        seen = self.has_variable("cache", "index")
        index = self.variable("cache", "index", jnp.zeros, (), jnp.int32) if self.decode else None
        if seen:  # the next positions, after those decoded so far
            at, index.value = index.value, index.value + h.shape[1]
            h = h + lax.dynamic_slice_in_dim(position, at, h.shape[1])[None].astype(h.dtype)
        else:
            h = h + positions(position, segments, h)
        h = nn.Dropout(self.dropout, deterministic=deterministic)(h)
        return h if segments is None else (h, segments)


class CausalBlock(nn.Module):
    """x + Dropout(CausalSelfAttention(LN(x))), then x + Dropout(MLP(LN(x))); the
    MLP is Dense(4·width), GELU, Dense(width)."""

    width: int
    heads: int
    depth: int
    dropout: float = 0.0
    decode: bool = False  # Flax's decode mode: keys and values in the 'cache' collection

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x, segments = with_segments(x)
        h = nn.LayerNorm(name="norm1")(x)
        split = nn.with_partitioning
        h = nn.MultiHeadDotProductAttention(
            self.heads, use_bias=False, kernel_init=split(INIT, COLUMNS),
            out_kernel_init=split(residual_init(self.depth), ROWS),
            dropout_rate=self.dropout, deterministic=deterministic, decode=self.decode,
            attention_fn=fused(nn.dot_product_attention), name="attention")(
                h, h, mask=causal_mask(x, segments))
        x = x + nn.Dropout(self.dropout, deterministic=deterministic)(h)
        h = nn.Dense(4 * self.width, kernel_init=split(INIT, COLUMNS),
                     bias_init=split(nn.initializers.zeros, VECTOR),
                     name="up")(nn.LayerNorm(name="norm2")(x))
        h = nn.Dense(self.width, kernel_init=split(residual_init(self.depth), ROWS),
                     name="down")(nn.gelu(h))
        x = x + nn.Dropout(self.dropout, deterministic=deterministic)(h)
        return x if segments is None else (x, segments)


class LMHead(nn.Module):
    """Final LayerNorm and a linear map to the vocabulary's logits (no bias):
    its own matrix, or the transpose of a shared token embedding's (tied)."""

    vocab: int
    decode: bool = False  # each position alone: decodes as it computes
    embed: nn.Module | None = None  # the token embedding, shared (tied)

    @nn.compact
    def __call__(self, x):
        x, _ = with_segments(x)
        if self.embed is not None:
            return self.embed.attend(nn.LayerNorm(name="norm")(x))
        return nn.Dense(self.vocab, use_bias=False, kernel_init=nn.with_partitioning(INIT, COLUMNS),
                        name="logits")(
            nn.LayerNorm(name="norm")(x))


def gpt(depth: int = 6, width: int = 128, heads: int = 4, context: int = 128, vocab: int = 256,
        dropout: float = 0.0, *, tie_embeddings: bool = False, api: str = "linen",
        rngs: nnx.Rngs | None = None) -> list:
    """A GPT of `depth` blocks of `width` with `heads` heads over `context`
    tokens of a `vocab`-token vocabulary (256: bytes); `depth + 2` layers.
    `tie_embeddings`: the head is the token embedding's transpose (one
    matrix, GPT-2's). `api="nnx"` builds the NNX twins (models/nnx_modules.py)
    from `rngs`."""
    if width % heads:
        raise ConfigError(f"pj.models.gpt(width={width}, heads={heads}): the width must be a "
                      f"multiple of the heads; use width={width // heads * heads or heads}")
    with nnx.use_eager_sharding(False):  # annotated, placed by the pipeline
        return _layers(depth, width, heads, context, vocab, dropout, tie_embeddings, api, rngs)


def _layers(depth: int, width: int, heads: int, context: int, vocab: int, dropout: float,
            tie: bool, api: str, rngs: nnx.Rngs | None) -> list:
    N = nnx_modules
    b = Builder("gpt", api, (context,), rngs, dtype=jnp.int32)
    embed = (nn.Embed(vocab, width, embedding_init=nn.with_partitioning(INIT, ROWS))
             if tie and api == "linen" else None)
    shared = (nnx.Embed(vocab, width, embedding_init=nnx.with_partitioning(INIT, ROWS),
                        rngs=b.rngs) if tie and api == "nnx" else None)
    b.add(TokenEmbed(vocab, width, context, dropout, embed=embed),
          lambda f, r: N.TokenEmbed(vocab, width, context, dropout, embed=shared, rngs=r))
    for _ in range(depth):
        b.add(CausalBlock(width, heads, depth, dropout),
              lambda f, r: N.CausalBlock(width, heads, depth, dropout, rngs=r))
    return b.add(LMHead(vocab, embed=embed),
                 lambda f, r: N.LMHead(width, vocab, embed=shared, rngs=r)).layers


def gpt_muon_dimensions(params) -> object:
    """Muon's reduction and output axes of each block matrix of `gpt`'s
    parameters, for `optax.contrib.muon(...,
    muon_weight_dimension_numbers=pj.models.gpt_muon_dimensions)`:
    attention's [width, heads, head] and [heads, head, width] kernels, the
    MLP's; None (Adam) for the embeddings, the head, biases and norms, as
    Muon is used (Jordan et al. 2024). The names are the dictionary keys of
    a leaf's path, linen's and NNX's alike: a kernel boxed with its tensor
    axes (`with_partitioning`) ends its path in the box's `.value`, which a
    rule on the last key would read, giving every matrix to Adam."""
    D = optax.contrib.MuonDimensionNumbers

    def dims(path, leaf):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if not names or names[-1] != "kernel" or "logits" in names:
            return None
        if "attention" in names:
            return D(reduction_axis=(0, 1), output_axis=2) if "out" in names else D(
                reduction_axis=0, output_axis=(1, 2))
        return D(reduction_axis=0, output_axis=1) if names[-2] in ("up", "down") else None
    return jax.tree_util.tree_map_with_path(dims, params)
