"""The GPT layer list: pipelined 1F1B equals the same layers run in sequence
under the next-token loss; it is causal; its NNX twin computes what the linen
model does; shared modules and bad settings are clear errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pipejax as pj
from tests.reference import (assert_pipelines_exactly, nnx_sequential_value_and_grad,
                             rel_err)

MB, M, T = 2, 4, 16
SIZE = dict(depth=2, width=32, heads=4, context=T)


def _tokens(seed, n=M * MB):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.randint(kx, (n, T), 0, 256), jax.random.randint(ky, (n, T), 0, 256)


def _pipeline(layers, stages, schedule="1f1b"):
    return pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((MB, T), jnp.int32),
                       targets=jnp.zeros((MB, T), jnp.int32), stages=stages, microbatches=M,
                       schedule=schedule)


@pytest.mark.parametrize("stages, dropout", [pytest.param(2, 0.1, marks=pytest.mark.slow),
                                             (4, 0.0)])
def test_gpt_pipelines_exactly(stages, dropout):
    layers = pj.models.gpt(**SIZE, dropout=dropout)
    assert [type(layer).__name__ for layer in layers] == (
        ["TokenEmbed"] + ["CausalBlock"] * 2 + ["LMHead"])
    pipe = _pipeline(layers, stages)
    params = pipe.init(jax.random.key(0))
    x, y = _tokens(1)
    loss, _ = pipe.value_and_grad(params, (x, y), jax.random.key(2))
    assert abs(float(loss) - np.log(256)) < 0.1  # small initial weights: near uniform
    assert_pipelines_exactly(pipe, layers, params, (x, y), pj.losses.next_token)


@pytest.mark.slow  # NNX pipelines are tested in layers/test_nnx.py; the twin below, fast
def test_nnx_gpt_pipelines_exactly():
    layers = pj.models.gpt(**SIZE, dropout=0.1, api="nnx", rngs=nnx.Rngs(0))
    pipe = _pipeline(layers, 2)
    params = pipe.init()
    x, y = _tokens(1)
    key = jax.random.key(2)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, M, pj.losses.next_token)(
        pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def _variables(layers, h):
    """Each linen layer initialized by Flax on the previous one's output."""
    out = []
    for i, layer in enumerate(layers):
        out.append(layer.init(jax.random.key(i), h))
        h = layer.apply(out[-1], h)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_fused_attention_equals_flax_einsum_attention(packed):
    """The zoo GPT's attention (one jax.nn.dot_product_attention) against
    Flax's einsum, softmax and einsum, linen's and NNX's, under the causal
    mask and, packed, the documents' mask; and a decode step's mask."""
    from pipejax.models.common import causal_mask, fused

    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 4, 8))
    segments = jnp.array([[0] * 6 + [1] * 10, [0] * 16]) if packed else None
    masks = [causal_mask(q, segments), jnp.arange(16)[None, None, None] <= 5]  # a decode step's
    for flax_attention in (nn.dot_product_attention, nnx.dot_product_attention):
        for mask, query in zip(masks, (q, q[:, 5:6])):
            ours = fused(flax_attention)(query, k, v, mask=mask, deterministic=True)
            theirs = flax_attention(query, k, v, mask=mask, deterministic=True)
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def test_gpt_is_causal():
    """Changing the tokens from position 9 on leaves the logits before 9 as
    they were, and changes those after."""
    layers = pj.models.gpt(**SIZE)
    x, _ = _tokens(3, 2)
    changed = x.at[:, 9:].set((x[:, 9:] + 7) % 256)
    run = lambda tokens: pj.apply_layers(layers, _variables(layers, x), tokens, train=False)
    before, after = run(x), run(changed)
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert float(jnp.abs(before[:, 9:] - after[:, 9:]).min()) > 0


def test_nnx_twin_computes_the_linen_model():
    """Each NNX layer, given its linen twin's parameters (the same names,
    path for path), returns the linen layer's output; shorter inputs too."""
    linen = pj.models.gpt(**SIZE)
    twin = pj.models.gpt(**SIZE, api="nnx", rngs=nnx.Rngs(1))
    x, _ = _tokens(4, 2)
    variables = _variables(linen, x)
    for i, (layer, module) in enumerate(zip(linen, twin)):
        # the annotated kernels' paths end in their box's value (GetAttrKey)
        keys = lambda path: tuple(k.key for k in path
                                  if not isinstance(k, jax.tree_util.GetAttrKey))
        flat = {keys(path): value for path, value in
                jax.tree_util.tree_flatten_with_path(variables[i]["params"])[0]}
        state = nnx.state(module, nnx.Param)
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        assert len(paths) == len(flat), type(module).__name__
        for p in paths:  # NNX paths end with the Variable's value
            key = tuple(k for k in p if not (isinstance(k, jax.tree_util.GetAttrKey)))
            names = tuple(getattr(k, "key", None) for k in key)
            value = flat[names]
            state = _set(state, names, value)
        nnx.update(module, state)
    h = x[:, :11]
    for layer, module, v in zip(linen, twin, variables):
        ours, theirs = layer.apply(v, h), module(h)
        np.testing.assert_allclose(theirs, ours, atol=2e-6, rtol=1e-5)
        h = ours


def _set(state, names, value):
    node = state
    for name in names[:-1]:
        node = node[name]
    node[names[-1]].set_value(value)
    return state


def test_shared_modules_are_tied_where_pipejax_keeps_the_copies_equal():
    """A pipeline ties a module two layers share (tests/models/test_tied.py);
    the asynchronous simulator, whose stages update apart, names it."""
    class TiedHead(nn.Module):
        embed: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.embed.attend(nn.LayerNorm()(x))

    embed = nn.Embed(256, 32)
    x = jnp.zeros((MB, T), jnp.int32)
    layers = [embed, nn.Dense(32), TiedHead(embed)]
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x, targets=x, stages=2,
                       microbatches=M)
    assert [t.holders for t in pipe.build.code.model.ties] == [
        ((0, ("params", "embedding")), (2, ("params", "embed", "embedding")))]
    with pytest.raises(pj.errors.LayerError, match=r"layers 0 \(Embed\) and 2 \(TiedHead\) share "
                                                   r"the module Embed"):
        pj.simulate(layers, loss=pj.losses.next_token, optimizer=optax.sgd(0.1), split=2)

    class Wrapper(nn.Module):  # one layer object listed twice is two layers, as before
        inner: nn.Module

        @nn.compact
        def __call__(self, x):
            return self.inner(x)

    twice = Wrapper(nn.Dense(32))
    specs = pj.trace([embed, twice, twice], x)
    assert [s.name for s in specs] == ["Embed", "Wrapper", "Wrapper"]


def test_bad_settings_and_targets_are_clear_errors():
    with pytest.raises(pj.errors.ConfigError, match=r"width=30, heads=4\).*use width=28"):
        pj.models.gpt(depth=2, width=30, heads=4)
    x = jnp.zeros((MB, T), jnp.int32)
    with pytest.raises(pj.errors.LayerError, match=r"next_token: logits \[2, 16, 256\] need "
                                                   r"targets \[2, 16\].*not \[2\]"):
        pj.pipeline(pj.models.gpt(depth=2, width=32, heads=4, context=T),
                    loss=pj.losses.next_token, example=x, stages=2, microbatches=M)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_muon_dimensions_give_muon_every_block_matrix_through_its_box(api):
    """Six matrices a block (four attention kernels, up, down) get Muon's
    axes, covering each kernel's axes; the rest Adam. Muon's update of a
    boxed MLP kernel is near orthogonal (its singular values within 2× of
    one another), where Adam's first step (the gradient's signs) is not."""
    layers = pj.models.gpt(**SIZE, api=api, rngs=nnx.Rngs(0) if api == "nnx" else None)
    params = pj.simulate(layers, loss=pj.losses.next_token, optimizer=optax.sgd(0.1),
                         split=1).variables(jax.random.key(0), jnp.zeros((MB, T), jnp.int32))
    dims = pj.models.gpt_muon_dimensions(params)
    is_dims = lambda d: isinstance(d, optax.contrib.MuonDimensionNumbers)
    every = jax.tree.leaves(dims, is_leaf=lambda d: d is None or is_dims(d))
    pairs = [(d, p) for d, p in zip(every, jax.tree.leaves(params), strict=True) if d is not None]
    assert len(pairs) == 6 * SIZE["depth"]
    axes = lambda a: {a} if isinstance(a, int) else set(a)
    for d, p in pairs:
        assert axes(d.reduction_axis) | axes(d.output_axis) == set(range(p.ndim))
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)

    def spread(optimizer):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        up = next(u for path, u in jax.tree_util.tree_leaves_with_path(updates)
                  if "['up']['kernel']" in jax.tree_util.keystr(path))
        s = np.linalg.svd(np.asarray(up), compute_uv=False)
        return s.max() / s.min()
    assert spread(optax.contrib.muon(1.0, beta=0.0, muon_weight_dimension_numbers=dims)) < 2
    assert spread(optax.adam(1.0)) > 2
