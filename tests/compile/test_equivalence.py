"""Synchronous pipelines equal the sequential computation (GPipe §2)."""

import jax
import jax.numpy as jnp
import pytest

import pipejax as pj
from tests.cases import fast_and_slow
from tests.reference import (batch, heterogeneous_layers, rel_err, sequential_loss,
                             sequential_value_and_grad)

MB = 4  # examples per micro-batch


def _check(K, M, remat="stage", partition="variance"):
    layers = heterogeneous_layers()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, remat=remat, partition=partition)
    params = pipe.init(jax.random.key(1))
    x, y = batch(M * MB)
    key = jax.random.key(7)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    variables = pj.unstage(params)
    ref_loss, ref_grads = sequential_value_and_grad(layers, M)(variables, x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5
    return pipe


@pytest.mark.parametrize("K,M", fast_and_slow([(K, M) for M in (1, 4, 8) for K in (1, 2, 4, 8)],
                                               fast=[(8, 1)]))  # M > K: test_schedules.py
def test_loss_and_grads_equal_sequential(K, M):
    pipe = _check(K, M)
    assert pipe.plan.stages == K


@pytest.mark.parametrize("remat", fast_and_slow(  # "stage", the default, runs everywhere
    ["none", "stage", jax.checkpoint_policies.dots_saveable],
    fast=["none", jax.checkpoint_policies.dots_saveable]))
def test_every_remat_mode_equals_sequential(remat):
    _check(4, 4, remat=remat)


def test_explicit_split():
    assert _check(3, 2, partition=[5, 4, 4]).plan.split == (5, 4, 4)


@pytest.mark.slow
def test_bottleneck_partition():
    _check(3, 2, partition="bottleneck")


def test_dropout_keys_differ_by_microbatch_and_layer():
    """Two micro-batches holding the same examples must see different dropout
    masks: a pipeline that reused one key would give equal losses."""
    layers = [pj.models.mlp(1, 64, 10)[0], pj.models.mlp(1, 64, 10, dropout=0.5)[2],
              pj.models.mlp(1, 64, 10)[-1]]
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=1, microbatches=2)
    params = pipe.init(jax.random.key(0))
    x, y = batch(MB)
    x2, y2 = jnp.concatenate([x, x]), jnp.concatenate([y, y])
    variables = pj.unstage(params)
    key = jax.random.key(3)
    per_mb = [pj.losses.cross_entropy(pj.apply_layers(layers, variables, x, jax.random.fold_in(key, m)), y)
              for m in range(2)]
    assert abs(float(per_mb[0] - per_mb[1])) > 1e-4
    loss, _ = pipe.value_and_grad(params, (x2, y2), key)
    assert rel_err(loss, (per_mb[0] + per_mb[1]) / 2) < 1e-6


def test_mse_loss_and_non_float_targets_shape():
    layers = [pj.models.mlp(1, 16, 3)[0], jnp.tanh, pj.models.mlp(1, 16, 3)[-1]]
    pipe = pj.pipeline(layers, loss=pj.losses.mse, example=jnp.zeros((MB, 20)),
                       targets=jnp.zeros((MB, 3)), stages=3, microbatches=2)
    params = pipe.init(jax.random.key(0))
    x, _ = batch(2 * MB)
    y = jnp.ones((2 * MB, 3))
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = jax.value_and_grad(sequential_loss, argnums=1)(
        layers, pj.unstage(params), x, y, 2, jax.random.key(0), pj.losses.mse)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5
