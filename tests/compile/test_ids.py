"""`pj.pipeline(checks=True)`: ids out of range are named before the step, not a NaN loss."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj

MB, M, T = 2, 2, 8


def _gpt(**kw):
    x = jnp.zeros((MB, T), jnp.int32)
    return pj.pipeline(pj.models.gpt(depth=1, width=16, heads=2, context=T), checks=True,
                       loss=pj.losses.next_token, example=x, targets=x, stages=2,
                       microbatches=M, **kw)


def test_tokens_past_the_vocabulary_and_negative_targets_are_named():
    pipe = _gpt()
    params = pipe.init(jax.random.key(0))
    x = jnp.zeros((M * MB, T), jnp.int32)
    with pytest.raises(pj.errors.BatchError, match=r"value_and_grad: inputs holds 2 ids outside "
                       r"\[0, 256\): 256, 300;"):
        pipe.value_and_grad(params, (x.at[0, 1].set(300).at[3, 0].set(256), x))
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.abstract_state(params, jax.random.key(0))
    with pytest.raises(pj.errors.BatchError, match=r"trainer.step: targets holds 1 ids outside "
                       r"\[0, 256\): -1;"):
        trainer.step(state, (x, x.at[2, 2].set(-1)))
    loss, _ = pipe.value_and_grad(params, (x.at[0, 1].set(255), x))  # in range: runs
    assert jnp.isfinite(loss)
    shapes = jax.ShapeDtypeStruct(x.shape, x.dtype)  # lowered on shapes: no ids to check
    pipe.shapes.of((shapes, shapes), "trainer.step.lower")


def test_class_labels_are_bounded_by_the_outputs():
    pipe = pj.pipeline(pj.models.mlp(depth=2, width=16), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 40)), stages=2, microbatches=M, checks=True)
    labels = jnp.asarray([0, 9, 10, 3])
    with pytest.raises(pj.errors.BatchError, match=r"targets holds 1 ids outside \[0, 10\): 10"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)), (jnp.zeros((M * MB, 40)), labels))
