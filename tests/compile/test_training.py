"""The trainer trains like sequential optax steps; its state, compilation and parameters."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.cases import fast_and_slow
from tests.reference import batch, heterogeneous_layers, rel_err, sequential_loss

K, M, MB = 4, 4, 4
COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: COMPILES.append(name) if name.endswith("backend_compile_duration")
    else None)


def _pipe(**kw):
    return pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=K, microbatches=M, **kw)


def test_twenty_steps_equal_sequential_optax():
    """Loss, parameters and each stage's optimizer state after 20 steps equal
    20 sequential optax steps on the whole layer list (dropout active)."""
    pipe = _pipe()
    layers = pipe.layers
    opt = optax.sgd(0.1, momentum=0.9)
    params = pipe.init(jax.random.key(0))
    trainer = pipe.trainer(opt)
    state = trainer.init(params, jax.random.key(5))
    variables = pj.unstage(params)
    opt_state = opt.init(variables)

    @jax.jit
    def sequential_step(v, s, x, y, t):
        key = jax.random.fold_in(jax.random.key(5), t)
        loss, g = jax.value_and_grad(sequential_loss, argnums=1)(layers, v, x, y, M, key)
        u, s = opt.update(g, s, v)
        return optax.apply_updates(v, u), s, loss

    x, y = batch(M * MB)
    losses = []
    for t in range(20):
        state, metrics = trainer.step(state, (x, y))
        variables, opt_state, ref_loss = sequential_step(variables, opt_state, x, y, t)
        assert rel_err(metrics["loss"], ref_loss) < 1e-4
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 20
    assert rel_err(pj.unstage(state.params), variables) < 1e-4
    assert losses[-1] < 0.5 * losses[0]  # it learned, not just agreed
    per_stage = trainer.opt_state(state)
    for k, r in enumerate(pipe.plan.ranges):  # stage k's momentum is that of its layers
        got, want = per_stage[k][0].trace, opt_state[0].trace[r.start:r.stop]
        assert jax.tree.structure(got) == jax.tree.structure(want)
        if jax.tree.leaves(want):
            assert rel_err(got, want) < 1e-4


def test_metrics_are_arrays_with_each_micro_batch():
    pipe = _pipe()
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
    x, y = batch(M * MB)
    state, first = trainer.step(state, (x, y))
    state, second = trainer.step(state, (x, y))
    for m in (first, second):
        assert all(isinstance(v, jax.Array) for v in m.values())
        assert int(m["completed"]) == M
        np.testing.assert_allclose(float(m["loss"]), np.mean(np.asarray(m["losses"])), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(second["microbatch"]), np.arange(M, 2 * M))
    state, flushed = trainer.flush(state)  # synchronous: nothing in flight
    assert int(flushed["completed"]) == 0 and np.isnan(float(flushed["loss"]))
    assert isinstance(flushed["loss"], jax.Array)


@pytest.mark.parametrize("schedule", fast_and_slow(["1f1b", "pb"], fast=["pb"]))  # PB: its in-flight state
def test_the_step_compiles_once(schedule):
    """The same compiled program from the first call on: the state `init`
    makes is placed and typed as the state `step` returns."""
    pipe = _pipe(schedule=schedule)
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
    batches = [batch(M * MB, seed=s) for s in range(6)]
    jax.block_until_ready(batches)
    before = len(COMPILES)
    state, _ = trainer.step(state, batches[0])
    assert len(COMPILES) - before == 1
    for b in batches[1:]:
        state, metrics = trainer.step(state, b)
    jax.block_until_ready(metrics)
    assert len(COMPILES) - before == 1


@pytest.mark.slow  # nine seconds of two trainers
def test_two_trainers_of_one_pipeline_are_independent():
    pipe = _pipe()
    params = pipe.init(jax.random.key(0))
    x, y = batch(M * MB)
    key = jax.random.key(2)
    _, grads = pipe.value_and_grad(params, (x, y), jax.random.fold_in(key, 0))
    fast, slow = pipe.trainer(optax.sgd(0.1)), pipe.trainer(optax.sgd(0.01))
    s_fast, s_slow = fast.init(params, key), slow.init(params, key)
    s_fast, _ = fast.step(s_fast, (x, y))
    s_slow, _ = slow.step(s_slow, (x, y))
    before, g = pj.unstage(params), pj.unstage(grads)
    for state, lr in ((s_fast, 0.1), (s_slow, 0.01)):
        want = jax.tree.map(lambda p, d: p - lr * d, before, g)
        assert rel_err(pj.unstage(state.params), want) < 1e-5


def test_compiled_step_is_the_step():
    pipe = _pipe()
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
    x, y = batch(M * MB)
    compiled = trainer.step.lower(state, (x, y)).compile()
    a, ma = compiled(jax.tree.map(jnp.copy, state), (x, y))  # both donate their state
    b, mb = trainer.step(state, (x, y))
    chex.assert_trees_all_equal(pj.unstage(a.params), pj.unstage(b.params))
    assert float(ma["loss"]) == float(mb["loss"])


@pytest.mark.slow  # per-stage optimizers train in test_mitigations.py
def test_optimizer_per_stage_gets_its_stage_info():
    seen = []

    def make(info: pj.StageInfo):
        seen.append(info)
        return optax.sgd(0.1 * (info.stage + 1))  # a different rate per stage

    pipe = _pipe()
    params = pipe.init(jax.random.key(0))
    trainer = pipe.trainer(make)
    state = trainer.init(params, jax.random.key(3))
    assert [s.stage for s in seen] == list(range(K))
    assert all(s.stages == K and s.delay == 0 for s in seen)
    x, y = batch(M * MB)
    _, grads = pipe.value_and_grad(params, (x, y), jax.random.fold_in(state.key, 0))
    state, _ = trainer.step(state, (x, y))
    before, after, g = pj.unstage(params), pj.unstage(state.params), pj.unstage(grads)
    for k, layer_range in enumerate(pipe.plan.ranges):
        for i in layer_range:
            expected = jax.tree.map(lambda p, d: p - 0.1 * (k + 1) * d, before[i], g[i])
            chex.assert_trees_all_close(after[i], expected, rtol=1e-5, atol=1e-6)


def test_init_is_flax_init_of_each_layer():
    """Layer i holds what Flax's own `layer.init` gives with fold_in(key, i)."""
    pipe = _pipe()
    key = jax.random.key(3)
    got = pj.unstage(pipe.init(key))
    for spec, layer, variables in zip(pipe.specs, pipe.layers, got):
        if not (isinstance(layer, nn.Module) and spec.param_bytes):
            assert variables == {}
            continue
        want = layer.init(jax.random.fold_in(key, spec.index), jnp.zeros(spec.input.shape))
        chex.assert_trees_all_equal(variables, dict(want))


def test_a_layer_init_compiles_once_for_every_pipeline_of_equal_layers():
    """Each layer's init program serves pipelines of equal layers on equal
    input shapes at any K, schedule or position (the index is an argument);
    another input shape compiles its own."""
    inits = []
    listen = lambda name, secs, fun_name="", **kw: inits.append(fun_name) if (
        name.endswith("backend_compile_duration") and "layer_init" in fun_name) else None
    build = lambda stages, width=19, **kw: pj.pipeline(
        [nn.Dense(11), nn.relu, nn.Dense(11), nn.Dense(10)], loss=pj.losses.cross_entropy,
        example=jnp.zeros((MB, width)), stages=stages, microbatches=2, **kw)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = pj.unstage(build(1).init(jax.random.key(3)))
        assert len(inits) <= 3  # Dense(11) on 19 and on 11 features, Dense(10) on 11
        before = len(inits)
        chex.assert_trees_all_equal(pj.unstage(build(2, schedule="pb").init(jax.random.key(3))),
                                    first)
        chex.assert_trees_all_equal(pj.unstage(build(4).init(jax.random.key(3))), first)
        assert len(inits) == before
        build(2, width=23).init(jax.random.key(3))
        assert len(inits) == before + 1  # the first Dense(11), on 23 features
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_unstage_does_not_depend_on_the_number_of_stages():
    layers = heterogeneous_layers()
    trees = []
    for k in (1, 2, 4):
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                           stages=k, microbatches=2)
        trees.append(pj.unstage(pipe.init(jax.random.key(3))))
    assert len(trees[0]) == len(layers)
    assert trees[0][1] == {} and trees[0][2] == {}  # relu and a lambda have no variables
    for other in trees[1:]:
        chex.assert_trees_all_equal(trees[0], other)


def test_stage_is_the_inverse_of_unstage():
    pipe = _pipe()
    params = pipe.init(jax.random.key(1))
    again = pipe.stage(pj.unstage(params))
    for a, b in zip(params.buffers, again.buffers):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.spec == a.sharding.spec


def test_parameters_live_on_their_stage_devices():
    pipe = _pipe()
    params = pipe.init(jax.random.key(1))
    for buf in params.buffers:
        assert buf.shape[0] == K
        rows = {s.device: s.index[0] for s in buf.addressable_shards}
        assert sorted(r.start for r in rows.values()) == list(range(K))
