"""Every schedule runs on the one table interpreter: synchronous tables equal
the sequential computation, asynchronous ones a versioned reference loop,
micro-batch by micro-batch, well into the steady state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.bench.memory import peak_bytes
from pipejax.compile.metrics import finishing
from pipejax.errors import ConfigError
from tests.cases import fast_and_slow
from tests.reference import (batch, fill_microbatches, heterogeneous_layers, rel_err,
                             sequential_value_and_grad, train_async)

MB = 2


GRID = [(K, M) for K in (2, 4, 8) for M in (K, 2 * K, 4 * K)]
# GPipe at the grid points that tests/compile/test_equivalence.py does not cover.
GPIPE_REST = [(K, M) for K, M in GRID if not (K in (1, 2, 4, 8) and M in (1, 4, 8))]


@pytest.mark.parametrize("schedule,K,M", fast_and_slow(
    [("1f1b", K, M) for K, M in GRID] + [("gpipe", K, M) for K, M in GPIPE_REST],
    fast=[("1f1b", 8, 8), ("gpipe", 4, 16)]))
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


@pytest.mark.parametrize("schedule", fast_and_slow(["pb", "pipedream"], fast=["pipedream"]))
def test_one_stage_is_per_micro_batch_sgd_with_momentum(schedule):
    pipe, state, losses, ref, ref_losses = train_async(schedule, 1, 4, stash=False)[:5]
    assert pipe.schedule.delays == [0]
    assert rel_err(pj.unstage(state.params), ref) < 1e-5
    assert rel_err(losses, ref_losses) < 1e-5


# With the slow tests: PB runs against the versioned reference in
# tests/compile/test_mitigations.py, PipeDream with stashing in the test after this one.
@pytest.mark.slow
@pytest.mark.parametrize("schedule,K,stash", [
    (s, K, stash) for s in ("pb", "pipedream") for K, stash in ((4, False), (4, True), (8, True))])
def test_asynchronous_schedules_equal_the_versioned_reference(schedule, K, stash):
    pipe, state, losses, ref, ref_losses = train_async(schedule, K, 2, stash)[:5]
    assert pipe.schedule.delays[0] == (2 * (K - 1) if schedule == "pb" else K - 1)
    assert len(losses) >= fill_microbatches(pipe.schedule) + 2 * K + 2
    assert rel_err(losses, ref_losses) < 1e-5  # every micro-batch's loss, fill and steady state
    assert rel_err(pj.unstage(state.params), ref) < 1e-5


@pytest.mark.slow  # stashing itself runs fast in the schedules' equality cases
def test_weight_stashing_with_kept_residuals_and_its_memory():
    pipe, state, losses, ref, ref_losses = train_async("pipedream", 4, 2, stash=True,
                                                       remat="none")[:5]
    assert rel_err(losses, ref_losses) < 1e-5
    assert rel_err(pj.unstage(state.params), ref) < 1e-5
    # PipeDream keeps one weight version per micro-batch in flight on a stage,
    # plus one: D_0 + 1 = K = 4 on stage 0, the most any stage needs
    assert pipe.schedule.delays[0] + 1 == pipe.layout.kept_slots == 4
    assert pipe.layout.weight_stash_bytes == 4 * pipe.layout.params.slot_bytes()


def test_the_pipeline_keeps_running_between_steps():
    """A step feeds M micro-batches and reports those the last stage finished:
    none while the pipeline fills (loss NaN), then M per step."""
    pipe = pj.pipeline(pj.models.mlp(3, 16, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=4, microbatches=2, schedule="pb")
    trainer = pipe.trainer(optax.sgd(0.01))
    state = trainer.init(pipe.init(jax.random.key(0)))
    counts, first = [], None
    for s in range(6):
        state, metrics = trainer.step(state, batch(2 * MB, seed=s))
        counts.append(int(metrics["completed"]))
        first = metrics if first is None else first
    # PB, K = 4: micro-batch g finishes on the last stage at tick g + 3; a step is 2 ticks
    assert counts == [0, 1, 2, 2, 2, 2]
    expected = [int(np.sum((s * 2 + finishing(pipe.schedule) >= 0))) for s in range(6)]
    assert counts == expected
    assert np.isnan(float(first["loss"])) and np.isnan(np.asarray(first["losses"])).all()
    assert int(state.step) == 6 and int(state.inflight.base) == 12
    state, metrics = trainer.flush(state)
    assert int(metrics["completed"]) == 12 - sum(counts)
    assert int(state.inflight.start) == int(state.inflight.fed) == int(state.inflight.base)


@pytest.mark.slow  # asynchronous tables at one M run fast
def test_an_asynchronous_step_of_more_micro_batches_trains_the_same():
    """Nothing drains between asynchronous steps, so M only sets how many
    micro-batches one call runs: 16 micro-batches as 8 steps of 2 or 2 steps
    of 8 give the same weights, bit for bit (a larger M amortizes the
    per-call cost at micro-batch size 1). PipeDream's steps are the same
    interpreter over its own table."""
    x, y = batch(16 * MB)
    opt = pj.transforms.mitigation("lwp+sc", 0.01, momentum=0.9).optimizer
    layers = [nn.Dense(16), nn.Dropout(0.2), nn.relu, nn.Dense(10)]
    out = []
    for M in (2, 8):
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                           stages=2, microbatches=M, schedule="pb")
        trainer = pipe.trainer(opt)
        state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
        for i in range(0, 16 * MB, M * MB):
            state, _ = trainer.step(state, (x[i:i + M * MB], y[i:i + M * MB]))
        out.append(pj.unstage(trainer.flush(state)[0].params))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(a, b)


def test_stage_info_of_an_asynchronous_schedule():
    seen = []
    pipe = pj.pipeline(pj.models.mlp(3, 16, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=4, microbatches=2, schedule="pb")
    pipe.trainer(lambda info: seen.append(info) or optax.sgd(0.1))
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
    peak = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = pj.pipeline(pj.models.mlp(7, 64, 10), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((8, 20)), stages=4, microbatches=16, schedule=schedule)
        trainer = pipe.trainer(optax.sgd(0.1))
        state = trainer.init(pipe.init(jax.random.key(0)))
        compiled = trainer.step.lower(state, batch(16 * 8)).compile()
        peak[schedule] = peak_bytes(compiled)
    # GPipe stashes all M = 16 stage inputs, 1F1B at most K = 4: the gap in
    # the step's peak (its rings are in the state it takes) is 12 inputs of
    # 8 × 64 float32 (24 KiB) on the widest stage, less what XLA's buffer
    # assignment packs differently in the two programs (none, measured)
    assert peak["gpipe"] - peak["1f1b"] >= 0.95 * 12 * 8 * 64 * 4


def _one_lane(schedule: pj.Schedule) -> pj.Schedule:
    """The same tasks with F and BW in one lane (each cell holds at most one)."""
    table = schedule.table
    merged = np.where((table[:, :, 0, 0] != pj.schedules.Op.IDLE)[..., None], table[:, :, 0],
                      table[:, :, 1])
    return pj.Schedule(schedule.name, merged[:, :, None], schedule.microbatches,
                       schedule.asynchronous, schedule.placement)


# Both with the slow tests (make test-all): the zero-bubble and V tables run mixed lanes in make test.
@pytest.mark.parametrize("name", [pytest.param("1f1b", marks=pytest.mark.slow),
                                  pytest.param("pipedream", marks=pytest.mark.slow)])
def test_the_executor_dispatches_a_lane_of_mixed_ops(name):
    """1F1B and PipeDream run one op per stage and tick: as one lane holding
    both F and BW tasks (the executor reads each task's op) they train as
    their two-lane tables, to float32 rounding: the two step programs hold
    the same operations in different loops, which XLA may fuse differently."""
    K, M = 3, 4
    two = pj.schedules.make_schedule(name, pj.Placement(K), M)
    one = _one_lane(two)
    assert two.lanes == 2 and one.lanes == 1 and len(one.lane_ops(0)) == 2
    assert (one.fwd == two.fwd).all() and (one.bwd == two.bwd).all()
    assert one.delays == two.delays
    assert pj.schedules.ring_capacities(one) == pj.schedules.ring_capacities(two)
    results = []
    for schedule in (two, one):
        pipe = pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((MB, 20)), stages=K, microbatches=M,
                           schedule=schedule)
        trainer = pipe.trainer(optax.sgd(0.05, momentum=0.9))
        state = trainer.init(pipe.init(jax.random.key(1)), jax.random.key(2))
        losses = []
        for s in range(2):
            state, m = trainer.step(state, batch(M * MB, seed=s))
            losses.append(m["losses"])
        state, m = trainer.flush(state)
        results.append((losses, m["losses"], state.params.buffers))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
