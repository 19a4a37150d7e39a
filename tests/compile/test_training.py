"""`pipe.step` trains like sequential optax steps; state, unstage and StageInfo."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from tests.reference import batch, heterogeneous_layers, rel_err, sequential_loss

K, M, MB = 4, 4, 4


def _pipe(**kw):
    return pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=K, microbatches=M, **kw)


def test_twenty_steps_equal_sequential_optax():
    pipe = _pipe()
    layers = pipe.layers
    opt = optax.sgd(0.1, momentum=0.9)
    params = pipe.init(jax.random.key(0))
    state = pipe.init_state(params, opt, key=jax.random.key(5))
    variables = pj.unstage(params)
    opt_state = opt.init(variables)

    @jax.jit
    def sequential_step(v, s, x, y, t):
        key = jax.random.fold_in(jax.random.key(5), t)
        loss, g = jax.value_and_grad(sequential_loss, argnums=1)(layers, v, x, y, M, key)
        u, s = opt.update(g, s, v)
        return optax.apply_updates(v, u), s, loss

    x, y = batch(M * MB)
    first = None
    for t in range(20):
        state, metrics = pipe.step(state, (x, y))
        variables, opt_state, ref_loss = sequential_step(variables, opt_state, x, y, t)
        assert rel_err(metrics["loss"], ref_loss) < 1e-4
        first = first if first is not None else float(metrics["loss"])
    assert int(state.step) == 20
    assert rel_err(pj.unstage(state.params), variables) < 1e-4
    assert float(metrics["loss"]) < 0.5 * first  # it learned, not just agreed


def test_step_is_the_jitted_function():
    pipe = _pipe()
    state = pipe.init_state(pipe.init(jax.random.key(0)), optax.adam(1e-3))
    compiled = pipe.step.lower(state, batch(M * MB)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_optimizer_per_stage_gets_its_stage_info():
    seen = []

    def make(info: pj.StageInfo):
        seen.append(info)
        return optax.sgd(0.1 * (info.stage + 1))  # a different rate per stage

    pipe = _pipe()
    params = pipe.init(jax.random.key(0))
    state = pipe.init_state(params, make)
    assert [s.stage for s in seen] == list(range(K))
    assert all(s.stages == K and s.delay == 0 for s in seen)
    x, y = batch(M * MB)
    _, grads = pipe.value_and_grad(params, (x, y), jax.random.fold_in(state.key, 0))
    state, _ = pipe.step(state, (x, y))
    before, after, g = pj.unstage(params), pj.unstage(state.params), pj.unstage(grads)
    for k, layer_range in enumerate(pipe.plan.ranges):
        for i in layer_range:
            expected = jax.tree.map(lambda p, d: p - 0.1 * (k + 1) * d, before[i], g[i])
            chex.assert_trees_all_close(after[i], expected, rtol=1e-5, atol=1e-6)


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
