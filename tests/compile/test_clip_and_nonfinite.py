"""Numerical guards: the global-norm clip over all stages, the non-finite guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.reference import batch, rel_err, sequential_value_and_grad

M, MB = 4, 2
LAYERS = pj.models.mlp(depth=4, width=16, classes=10)


def _pipe(schedule="gpipe", K=4):
    return pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule)


def test_global_norm_clip_equals_optax_on_the_sequential_model():
    pipe, opt = _pipe(), optax.sgd(0.1)
    trainer = pipe.trainer(opt, clip_norm=0.05)
    params = pipe.init(jax.random.key(0))
    state = trainer.init(params)
    v = pj.unstage(params)
    ref = optax.chain(optax.clip_by_global_norm(0.05), opt)
    ref_state, grad = ref.init(v), sequential_value_and_grad(LAYERS, M)
    for i in range(3):
        x, y = batch(M * MB, seed=i)
        state, _ = trainer.step(state, (x, y))
        _, g = grad(v, x, y, jax.random.key(0))
        assert float(optax.tree.norm(g)) > 0.05 * 10  # the clip acts, not per stage
        u, ref_state = ref.update(g, ref_state, v)
        v = optax.apply_updates(v, u)
    assert rel_err(pj.unstage(state), v) < 1e-5


def test_clip_norm_must_be_positive():
    with pytest.raises(pj.errors.ConfigError, match="clip_norm=0"):
        _pipe().trainer(optax.sgd(0.1), clip_norm=0)


def test_synchronous_step_with_a_nan_is_skipped_and_counted():
    pipe = _pipe()
    trainer = pipe.trainer(optax.adam(0.1), skip_nonfinite=True)
    state = trainer.init(pipe.init(jax.random.key(0)))
    x, y = batch(M * MB)
    before = jax.tree.map(jnp.copy, state)  # the step donates `state`
    after, m = trainer.step(state, (x.at[0, 0].set(jnp.nan), y))
    assert int(m["skipped"]) == 1 and int(after.step) == 1
    for a, b in zip(jax.tree.leaves((after.params.buffers, after.opt_state.buffers)),
                    jax.tree.leaves((before.params.buffers, before.opt_state.buffers))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, m = trainer.step(after, (x, y))
    assert int(m["skipped"]) == 0


def test_asynchronous_guard_skips_each_stage_update_of_the_bad_microbatch():
    pipe = _pipe("pb")
    trainer = pipe.trainer(optax.sgd(0.1), skip_nonfinite=True, clip_norm=1.0)
    state = trainer.init(pipe.init(jax.random.key(0)))
    x, y = batch(M * MB)
    state, m = trainer.step(state, (x.at[0, 0].set(jnp.nan), y))
    skipped = int(m["skipped"])
    for _ in range(2):
        state, m = trainer.step(state, (x, y))
        skipped += int(m["skipped"])
    # micro-batch 0 reaches every stage's backward once; the other stages'
    # updates at those ticks still apply (the clip's norm leaves it out)
    assert skipped == 4
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(pj.unstage(state)))
    assert np.isfinite(float(m["loss"]))
