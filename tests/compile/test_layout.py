"""The buffer layout a compiled pipeline reports: slots, padding, stash memory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.compile import residuals
from pipejax.errors import ConfigError
from tests.reference import heterogeneous_layers


def _pipe(layers, K, **kw):
    return pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 20)),
                       stages=K, microbatches=4, **kw)


def test_identical_stages_need_no_padding():
    assert _pipe(heterogeneous_layers(), 1).layout.padding_overhead == 0.0  # one stage
    pipe = _pipe(pj.models.mlp(4, 20, 20)[:-1], 4)  # [Dense(20), relu] x 4
    assert pipe.plan.split == (2, 2, 2, 2)
    assert pipe.layout.padding_overhead == 0.0
    assert pipe.layout.padded_param_bytes == 4 * (20 * 20 + 20) * 4


def test_heterogeneous_padding_and_slots():
    pipe = _pipe(heterogeneous_layers(), 4)
    layout = pipe.layout
    largest = max(layout.params.slot_bytes(), 1)
    assert layout.padded_param_bytes == 4 * largest
    real = sum(pipe.plan.param_bytes)
    assert abs(layout.padding_overhead - (4 * largest / real - 1)) < 1e-12
    # GPipe keeps every one of the M = 4 stage inputs until its backward
    assert (layout.input_slots, layout.kept_slots, layout.data_slots) == (4, 4, 4)
    assert layout.weight_stash_bytes == 0
    text = str(pipe)
    assert "padding" in text and "ring: stage inputs" in text and "4 x" in text


def test_remat_none_keeps_what_the_matmuls_made():
    """A stage of Dense then a tanh GELU keeps the Dense's output and the
    tanh's under remat "none" (the GELU's arithmetic is made again in the
    backward); a policy that saves everything keeps its intermediates too."""
    layers = [nn.Dense(32), jax.nn.gelu, nn.Dense(10)]
    kept = lambda remat: [a.shape for a in jax.tree.leaves(_pipe(
        layers, 2, remat=remat, partition=(2, 1)).build.code.kept.abstract_tree(0))]
    assert kept("none") == [(4, 32), (4, 32)]
    assert len(kept(jax.checkpoint_policies.everything_saveable)) > 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_remat_none_drops_only_the_roundings_that_round_nothing(dtype):
    """jax.checkpoint rounds each value it keeps to its dtype; for float32
    that is the identity (XLA:CPU copied each one), for bfloat16 computed
    wider it is not: residuals.vjp drops the first alone, and its outputs,
    kept values and gradients are jax.vjp's."""
    f = jax.checkpoint(lambda w, h: jnp.tanh(h @ w) @ w, policy=residuals.costly)
    w, h = (jax.random.normal(k, (8, 8), dtype) for k in jax.random.split(jax.random.key(0)))
    rounds = lambda vjp: str(jax.make_jaxpr(lambda w, h: jax.tree.leaves(vjp(f, w, h)))(
        w, h)).count("reduce_precision")
    assert rounds(jax.vjp) > 0 and rounds(residuals.vjp) == (0 if dtype == jnp.float32 else
                                                            rounds(jax.vjp))
    (out, back), (want, want_back) = residuals.vjp(f, w, h), jax.vjp(f, w, h)
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves((out, back(out))),
                                                     jax.tree.leaves((want, want_back(want)))))


def test_remat_none_makes_relu_again():
    """nn.relu is a custom_jvp_call of elementwise primitives: under remat
    "none" a Dense, relu, Dense stage keeps the first Dense's output alone,
    not the relu's beside it."""
    layers = [nn.Dense(32), nn.relu, nn.Dense(32), nn.Dense(10)]
    pipe = _pipe(layers, 2, remat="none", partition=(3, 1))
    assert [a.shape for a in jax.tree.leaves(pipe.build.code.kept.abstract_tree(0))] == [(4, 32)]


def test_a_policy_that_saves_constants_gets_a_clear_error():
    """A policy saving `reshard`'s values keeps a scalar made of constants
    inside the program (shard_map stages it) that the kept ring, laid out
    outside it, has no slot for: a ConfigError says so."""
    policy = lambda prim, *_, **__: prim.name in ("reshard", "dot_general")
    tokens = jnp.zeros((2, 16), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=1, width=32, heads=2, context=16),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=2,
                       microbatches=2, remat=policy)
    x = jnp.zeros((4, 16), jnp.int32)
    with pytest.raises(ConfigError, match=r"virtual stage \d \(.*kept ring's layout.*dots_saveable"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)), (x, x), jax.random.key(1))
