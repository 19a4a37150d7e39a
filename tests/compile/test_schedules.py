"""Every schedule runs on the one executor: synchronous tables equal the
sequential computation, asynchronous ones equal a versioned reference loop."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.reference import (batch, heterogeneous_layers, rel_err, sequential_value_and_grad,
                             versioned_reference)

MB = 2


ISSUE_GRID = [(K, M) for K in (2, 4, 8) for M in (K, 2 * K, 4 * K)]
# GPipe at the grid points that tests/compile/test_equivalence.py does not cover.
GPIPE_REST = [(K, M) for K, M in ISSUE_GRID if not (K in (1, 2, 4, 8) and M in (1, 4, 8))]


@pytest.mark.parametrize("schedule,K,M", [("1f1b", K, M) for K, M in ISSUE_GRID] +
                         [("gpipe", K, M) for K, M in GPIPE_REST])
def test_synchronous_schedules_equal_sequential(schedule, K, M):
    layers = heterogeneous_layers()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule)
    params = pipe.init(jax.random.key(1))
    x, y = batch(M * MB)
    key = jax.random.key(2)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    ref_loss, ref_grads = sequential_value_and_grad(layers, M)(pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def _train_async(schedule, K, M, stash, steps=3, opt=None, remat="stage"):
    layers = heterogeneous_layers()
    opt = opt or optax.sgd(0.05, momentum=0.9)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule, weight_stashing=stash,
                       remat=remat)
    params = pipe.init(jax.random.key(1))
    state = pipe.init_state(params, opt, key=jax.random.key(9))
    xs, ys, completed = [], [], 0
    for s in range(steps):
        x, y = batch(M * MB, seed=s)
        xs += list(x.reshape(M, MB, 20))
        ys += list(y.reshape(M, MB))
        state, metrics = pipe.step(state, (x, y))
        completed += int(metrics["completed"])
    state, metrics = pipe.flush(state)
    completed += metrics["completed"]
    assert completed == steps * M  # every micro-batch fed came out of the pipeline once
    ref = versioned_reference(layers, pj.losses.cross_entropy, pipe.plan.ranges,
                              pipe.schedule.delays, pj.unstage(params), opt, xs, ys,
                              jax.random.key(9), stash)
    return pipe, state, ref


@pytest.mark.parametrize("schedule", ["pb", "pipedream"])
def test_one_stage_is_per_micro_batch_sgd_with_momentum(schedule):
    pipe, state, ref = _train_async(schedule, 1, 4, stash=False)
    assert pipe.schedule.delays == [0]
    assert rel_err(pj.unstage(state.params), ref) < 1e-5


@pytest.mark.parametrize("schedule", ["pb", "pipedream"])
@pytest.mark.parametrize("K,stash", [(4, False), (4, True), (8, False), (8, True)])
def test_asynchronous_schedules_equal_the_versioned_reference(schedule, K, stash):
    pipe, state, ref = _train_async(schedule, K, 2, stash)
    assert pipe.schedule.delays[0] > 0
    assert rel_err(pj.unstage(state.params), ref) < 1e-5


def test_weight_stashing_with_kept_residuals_and_its_memory():
    pipe, state, ref = _train_async("pipedream", 4, 2, stash=True, remat="none")
    assert rel_err(pj.unstage(state.params), ref) < 1e-5
    assert pipe.weight_stash_bytes == pipe.schedule.residual_capacity * \
        pipe.plan.param_packing.slot_bytes() > 0


def test_the_pipeline_keeps_running_between_steps():
    """A step feeds M micro-batches and reports those that completed in it."""
    pipe = pj.pipeline(pj.models.mlp(3, 16, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=4, microbatches=2, schedule="pb")
    state = pipe.init_state(pipe.init(jax.random.key(0)), optax.sgd(0.01))
    counts = []
    for s in range(6):
        state, metrics = pipe.step(state, batch(2 * MB, seed=s))
        counts.append(int(metrics["completed"]))
    assert counts[0] < 2 and counts[-1] == 2  # the fill, then one per micro-batch fed
    assert int(state.step) == 6


def test_stage_info_of_an_asynchronous_schedule():
    seen = []
    pipe = pj.pipeline(pj.models.mlp(3, 16, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=4, microbatches=2, schedule="pb")
    pipe.init_state(pipe.init(jax.random.key(0)), lambda info: seen.append(info) or optax.sgd(0.1))
    assert [s.delay for s in seen] == [6, 4, 2, 0]
    assert [(s.forward_horizon, s.backward_horizon) for s in seen] == [
        pipe.schedule.horizons(k) for k in range(4)] == [(6, 0), (5, 1), (4, 2), (3, 3)]


def test_asynchronous_misuse_is_a_clear_error():
    args = dict(loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)), stages=2, microbatches=2)
    layers = pj.models.mlp(2, 8, 10)
    pipe = pj.pipeline(layers, schedule="pb", **args)
    with pytest.raises(ConfigError, match="value_and_grad needs a synchronous schedule"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)), batch(2 * MB))
    with pytest.raises(ConfigError, match="remat='none'.*weight_stashing=True"):
        pj.pipeline(layers, schedule="pipedream", remat="none", **args)
    with pytest.raises(ConfigError, match="weight_stashing=True needs an asynchronous schedule"):
        pj.pipeline(layers, schedule="1f1b", weight_stashing=True, **args)


def test_1f1b_needs_less_memory_than_gpipe():
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = pj.pipeline(pj.models.mlp(7, 64, 10), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((8, 20)), stages=4, microbatches=16, schedule=schedule)
        state = pipe.init_state(pipe.init(jax.random.key(0)), optax.sgd(0.1))
        compiled = pipe.step.lower(state, batch(16 * 8)).compile()
        temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < temp["gpipe"]
