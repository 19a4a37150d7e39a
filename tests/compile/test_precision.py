"""Mixed precision: stages compute in bf16 on float32 master weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.reference import batch

M, MB = 4, 8


def _layers():
    return [nn.Dense(64), nn.relu, nn.Dense(64), nn.gelu, nn.Dense(48), nn.relu,
            nn.Dense(32, dtype=jnp.float32), nn.relu, nn.Dense(10)]


def _bf16_loss(layers, variables, x, y):
    """The same computation, sequential: float32 weights cast to bf16 (not
    the layer that sets its own dtype), the batch in bf16, the loss of float32
    logits, the mean over the micro-batches."""
    def one(xm, ym):
        own = [v if getattr(layer, "dtype", None) is not None
               else jax.tree.map(lambda a: a.astype(jnp.bfloat16), v)
               for layer, v in zip(layers, variables)]
        out = pj.apply_layers(layers, own, xm.astype(jnp.bfloat16))
        return pj.losses.cross_entropy(out.astype(jnp.float32), ym)

    split = lambda a: a.reshape(M, MB, *a.shape[1:])
    return jnp.mean(jax.vmap(one)(split(x), split(y)))


@pytest.mark.parametrize("K", [1, 4])
def test_bf16_pipeline_equals_the_sequential_bf16_computation(K):
    """Loss and gradients equal the sequential bf16 run. Tolerance: the
    float32 gradient sums of bf16 products agree to 2e-2 relative error
    (bf16 keeps 8 significant bits, 4e-3 per rounding, and XLA may order or
    fuse the bf16 matmuls' f32 accumulation differently in the two programs)."""
    layers = _layers()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, compute_dtype=jnp.bfloat16)
    params = pipe.init(jax.random.key(0))
    x, y = batch(M * MB)
    loss, grads = pipe.value_and_grad(params, (x, y))
    variables = pj.unstage(params)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda v: _bf16_loss(layers, v, x, y)))(variables)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-3)
    for got, want in zip(jax.tree.leaves(pj.unstage(grads)), jax.tree.leaves(ref_grads)):
        assert got.dtype == jnp.float32
        err = np.linalg.norm(np.asarray(got) - want) / max(np.linalg.norm(want), 1e-12)
        assert err < 2e-2
    if K > 1:  # the boundaries carry bf16, the weights stay float32
        assert {str(d) for d, _ in pipe.layout.acts.slots} == {"bfloat16"}
        assert {str(d) for d, _ in pipe.layout.params.slots} == {"float32"}


def test_master_weights_and_optimizer_state_stay_float32():
    pipe = pj.pipeline(_layers(), loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=2, microbatches=M, compute_dtype=jnp.bfloat16)
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    state, _ = trainer.step(state, batch(M * MB))
    leaves = jax.tree.leaves((state.params.buffers, state.opt_state.buffers))
    assert {str(a.dtype) for a in leaves} <= {"float32", "int32"}


def test_boundary_bytes_halve_in_bf16():
    kw = dict(loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)), stages=4, microbatches=M)
    f32 = pj.pipeline(_layers(), **kw).layout
    bf16 = pj.pipeline(_layers(), **kw, compute_dtype=jnp.bfloat16).layout
    assert bf16.acts.slot_bytes() * 2 == f32.acts.slot_bytes()
    assert bf16.params.slot_bytes() == f32.params.slot_bytes()


@pytest.mark.slow  # the bf16 step's path: test_bf16_pipeline_equals_the_sequential_bf16_computation
def test_bf16_training_reaches_the_float32_accuracy():
    """60 steps on the 8x8 digits, K = 2: bf16 within 3 points of float32
    (the two runs differ by rounding only)."""
    data = pj.data.load("digits")
    x_train = data.x_train.reshape(len(data.x_train), -1).astype(np.float32)
    x_test = data.x_test.reshape(len(data.x_test), -1).astype(np.float32)
    layers = [nn.Dense(128), nn.relu, nn.Dense(128), nn.relu, nn.Dense(10)]
    accuracy = pj.evaluation.evaluator(layers)
    results = {}
    for dtype in (None, jnp.bfloat16):
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((16, 64)),
                           stages=2, microbatches=4, compute_dtype=dtype)
        trainer = pipe.trainer(optax.adam(3e-3))
        state = trainer.init(pipe.init(jax.random.key(0)))
        for step, (xb, yb) in zip(range(60), pj.data.batches(x_train, data.y_train, 64, 0, 0)):
            state, _ = trainer.step(state, (xb, yb))
        results[dtype] = accuracy(pj.unstage(state.params), x_test, data.y_test)
    assert results[None] > 0.85
    assert abs(results[jnp.bfloat16] - results[None]) < 0.03


def test_compute_dtype_must_be_a_floating_dtype():
    with pytest.raises(pj.errors.ConfigError, match="not a floating-point dtype"):
        pj.pipeline(_layers(), loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                    stages=2, microbatches=M, compute_dtype=jnp.int8)
