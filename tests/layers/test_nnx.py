"""Flax NNX layer lists have the linen path's guarantees: every schedule's
gradients equal the sequential NNX model written with Flax's own API (or the
versioned reference), the given values are the initial parameters and come
back into the user's modules, checkpoints round-trip, and bad input is a
clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn
from flax import nnx

import pipejax as pj
from pipejax.errors import LayerError
from tests.cases import fast_and_slow
from tests.reference import (batch, nnx_heterogeneous_layers, nnx_sequential_value_and_grad,
                             rel_err, sequential_value_and_grad, train_async)

MB = 2


def _pipe(layers, K, M, **kw):
    return pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, **kw)


def _mlp(seed=0, dropout=0.0):
    r = nnx.Rngs(params=seed, dropout=seed + 1)
    layers = [nnx.Linear(20, 16, rngs=r), nnx.relu]
    if dropout:
        layers.append(nnx.Dropout(dropout, rngs=r))
    return layers + [nnx.Linear(16, 16, rngs=r), nnx.relu, nnx.Linear(16, 10, rngs=r)]


@pytest.mark.parametrize("schedule,K,M,remat", fast_and_slow(
    [("gpipe", 2, 4, "stage"), ("1f1b", 3, 3, "stage"), ("1f1b", 4, 4, "none"),
     ("gpipe", 2, 2, jax.checkpoint_policies.dots_saveable)],
    fast=[("gpipe", 2, 2, jax.checkpoint_policies.dots_saveable)]))
def test_synchronous_schedules_equal_the_sequential_nnx_model(schedule, K, M, remat):
    layers = nnx_heterogeneous_layers()
    pipe = _pipe(layers, K, M, schedule=schedule, remat=remat)
    params = pipe.init()
    x, y = batch(M * MB)
    key = jax.random.key(7)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    values = pj.unstage(params)
    assert all(isinstance(v, nnx.State) for v, l in zip(values, layers) if isinstance(l, nnx.Module))
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, M)(values, x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    # every parameter gets its gradient (the silent bug: an NNX module taken for a function)
    assert len(jax.tree.leaves(pj.unstage(grads))) == 2 * 6
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def test_dropout_streams_draw_per_micro_batch_and_step_key():
    """The reference above is not vacuous: the NNX Dropout draws from the
    pipeline's key, so two keys give two losses."""
    pipe = _pipe(nnx_heterogeneous_layers(), 2, 4)
    assert [s.index for s in pipe.random_layers] == [9]
    params, xy = pipe.init(), batch(4 * MB)
    a, _ = pipe.value_and_grad(params, xy, jax.random.key(1))
    b, _ = pipe.value_and_grad(params, xy, jax.random.key(2))
    assert abs(float(a) - float(b)) > 1e-4


# NNX layers on PB with a mitigation: test_mitigation_with_two_replicas_equals_the_reference.
@pytest.mark.slow
@pytest.mark.parametrize("schedule,K,stash", [("pb", 4, False), ("pipedream", 2, True)])
def test_asynchronous_schedules_equal_the_versioned_reference(schedule, K, stash):
    run = train_async(schedule, K, 2, stash, layers=_mlp(dropout=0.25))
    assert rel_err(run.losses, run.ref_losses) < 1e-5
    assert rel_err(pj.unstage(run.state.params), run.ref) < 1e-5


@pytest.mark.slow  # mitigations on replicas: tests/compile/test_data_parallel.py
def test_mitigation_with_two_replicas_equals_the_reference():
    """PB + LWP_D + SC_D over an NNX list, two SSGD replicas: the forecast,
    the compensation and the data rule act on nnx.State parameters."""
    mit = pj.transforms.mitigation("lwp+sc", 0.05, momentum=0.9)
    infos = [pj.schedules.pb(4, 2).stage_info(k) for k in range(4)]
    run = train_async("pb", 4, 2, False, opt=mit.optimizer, layers=_mlp(), R=2,
                      ref_opt=[mit.optimizer(i) for i in infos],
                      predict=[(i.delay, 0, "velocity", 0.05) for i in infos])
    assert rel_err(run.losses, run.ref_losses) < 1e-5
    assert rel_err(pj.unstage(run.state.params), run.ref) < 1e-5


def test_mixed_linen_and_nnx_layers():
    r = nnx.Rngs(0)
    layers = [nn.Dense(16), nnx.relu, nnx.LayerNorm(16, rngs=r), nn.Dense(16), jnp.tanh,
              nnx.Linear(16, 10, rngs=r)]
    pipe = _pipe(layers, 3, 2)
    params = pipe.init(jax.random.key(1))
    values = pj.unstage(params)
    linen_only = pj.unstage(_pipe([nn.Dense(16), nn.relu], 1, 1).init(jax.random.key(1)))[0]
    np.testing.assert_array_equal(values[0]["params"]["kernel"], linen_only["params"]["kernel"])
    np.testing.assert_array_equal(values[5]["kernel"][...], layers[5].kernel[...])
    x, y = batch(2 * MB)
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = sequential_value_and_grad(layers, 2)(values, x, y, jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(pj.unstage(grads), ref_grads) < 1e-5


def test_sequential_and_list_are_layer_lists():
    layers = _mlp()
    x, y = batch(2 * MB)
    losses = [float(_pipe(model, 2, 2).value_and_grad(_pipe(model, 2, 2).init(), (x, y))[0])
              for model in (layers, nnx.Sequential(*layers), nnx.List(layers))]
    assert losses[0] == losses[1] == losses[2]


def test_given_values_train_and_come_back_into_the_modules():
    model = nnx.Sequential(*_mlp(seed=3, dropout=0.1))
    pipe = _pipe(model, 2, 2, schedule="1f1b")
    params = pipe.init()
    given = jax.tree.map(np.array, nnx.state(model, nnx.Param))  # a copy: update writes in place
    for v, layer in zip(pj.unstage(params), model.layers):
        if jax.tree.leaves(v):
            assert rel_err(v, nnx.state(layer, nnx.Param)) == 0
    trainer = pipe.trainer(optax.adam(1e-2), clip_norm=1.0, skip_nonfinite=True)
    state = trainer.init(params, jax.random.key(0))
    for s in range(3):
        state, _ = trainer.step(state, batch(2 * MB, seed=s))
    values = pj.unstage(state, into=pipe.layers)  # pipe.layers: the modules as given
    trained = nnx.state(model, nnx.Param)
    assert rel_err(trained, given) > 1e-3  # the modules hold the trained values now
    fresh = nnx.Sequential(*_mlp(seed=8, dropout=0.1))
    pj.unstage(state, into=fresh)  # another model of the same structure
    assert rel_err(nnx.state(fresh, nnx.Param), trained) == 0
    x, _ = batch(8)
    model.eval()
    np.testing.assert_allclose(model(x), pj.apply_layers(model, values, x, train=False),
                               rtol=1e-6, atol=1e-6)
    assert pj.evaluator(model)(values, np.asarray(x), np.asarray(jnp.argmax(model(x), -1))) == 1.0


def test_values_reshaped_after_the_pipeline_was_built_are_an_error():
    layers = _mlp()
    pipe = _pipe(layers, 2, 2)
    layers[2].kernel = nnx.Param(jnp.zeros((16, 8)))
    with pytest.raises(pj.errors.ConfigError, match=r"layer 2 \(Linear\) has variables .*16, 16.* "
                                                    r"but was given .*16, 8"):
        pipe.init()


def test_checkpoint_round_trips_into_other_stages(tmp_path):
    layers = _mlp(seed=5)
    pipe4, pipe2 = _pipe(layers, 4, 2), _pipe(layers, 2, 2)
    four = pipe4.trainer(optax.adam(1e-2))
    state = four.init(pipe4.init())
    for s in range(2):
        state, _ = four.step(state, batch(2 * MB, seed=s))
    pj.save(tmp_path, four, state)
    two = pipe2.trainer(optax.adam(1e-2))
    restored = pj.restore(tmp_path, two)
    assert rel_err(pj.unstage(restored), pj.unstage(state)) == 0
    a, b = four.step(state, batch(2 * MB, seed=9))[1], two.step(restored, batch(2 * MB, seed=9))[1]
    assert rel_err(a["loss"], b["loss"]) < 1e-6


def test_fixed_batchnorm_statistics_are_constants():
    """A BatchNorm that only reads its statistics is exact: they are constants."""
    r = nnx.Rngs(0)
    norm = nnx.BatchNorm(16, use_running_average=True, rngs=r)
    nnx.update(norm, nnx.State({"mean": nnx.BatchStat(jnp.linspace(-1, 1, 16)),
                                "var": nnx.BatchStat(jnp.linspace(0.5, 2, 16))}))
    layers = [nnx.Linear(20, 16, rngs=r), norm, nnx.relu, nnx.Linear(16, 10, rngs=r)]
    pipe = _pipe(layers, 2, 2)
    params = pipe.init()
    x, y = batch(2 * MB)
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, 2)(pj.unstage(params), x, y,
                                                                    jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(pj.unstage(grads), ref_grads) < 1e-5


def test_constants_are_taken_when_the_pipeline_is_built():
    """A later nnx.update of a module's statistics changes neither the
    pipeline nor which stages share a branch (the values are copied)."""
    r = nnx.Rngs(0)
    a, b = (nnx.BatchNorm(16, use_running_average=True, rngs=r) for _ in range(2))
    nnx.update(b, nnx.state(a))  # b shares a's statistics arrays
    layers = [nnx.Linear(20, 16, rngs=r), a, nnx.Linear(16, 16, rngs=r), b,
              nnx.Linear(16, 10, rngs=r)]
    pipe = _pipe(layers, 3, 2, partition=[2, 2, 1])
    reference = jax.tree.map(np.array, nnx.state(b, nnx.BatchStat))
    nnx.update(b, nnx.State({"mean": nnx.BatchStat(jnp.full(16, 5.0))}))
    params, xy = pipe.init(), batch(2 * MB)
    loss, grads = pipe.value_and_grad(params, xy)
    nnx.update(b, reference)
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, 2)(pj.unstage(params), *xy,
                                                                    jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(pj.unstage(grads), ref_grads) < 1e-5


def test_a_scanned_stack_with_split_streams_and_a_shared_rngs():
    """A layer that scans over vmapped blocks (nnx.split_rngs: one dropout key
    per block), beside layers that keep one nnx.Rngs between them."""
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear, self.dropout = nnx.Linear(16, 16, rngs=rngs), nnx.Dropout(0.3, rngs=rngs)

        def __call__(self, x):
            return x + self.dropout(nnx.relu(self.linear(x)))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            make = nnx.split_rngs(splits=3)(nnx.vmap(Block, in_axes=0, out_axes=0))
            self.blocks = make(rngs)

        def __call__(self, x):
            return nnx.scan(lambda h, block: (block(h), None), in_axes=(nnx.Carry, 0))(
                x, self.blocks)[0]

    class Noise(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs  # the same Rngs in two layers: harmless, reseeded at each call

        def __call__(self, x):
            return x + 0.1 * jax.random.normal(self.rngs.noise(), x.shape)

    r = nnx.Rngs(params=0, dropout=1, noise=2)
    layers = [nnx.Linear(20, 16, rngs=r), Noise(r), Stack(r), Noise(r), nnx.Linear(16, 10, rngs=r)]
    pipe = _pipe(layers, 2, 2)
    assert [s.index for s in pipe.random_layers] == [1, 2, 3]
    params, xy, key = pipe.init(), batch(2 * MB), jax.random.key(3)
    loss, grads = pipe.value_and_grad(params, xy, key)
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, 2)(pj.unstage(params), *xy, key)
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(pj.unstage(grads), ref_grads) < 1e-5
    assert abs(float(pipe.value_and_grad(params, xy, jax.random.key(4))[0]) - float(loss)) > 1e-3


# ------------------------------------------------------------------ bad input
def test_batchnorm_that_writes_its_statistics_is_an_error():
    layers = [nnx.Linear(20, 16, rngs=nnx.Rngs(0)), nnx.BatchNorm(16, rngs=nnx.Rngs(0)),
              nnx.Linear(16, 10, rngs=nnx.Rngs(0))]
    with pytest.raises(LayerError, match=r"layer 1 \(BatchNorm\) writes BatchStat mean, "
                                         r"BatchStat var in its forward.*nnx.GroupNorm"):
        _pipe(layers, 2, 2)


def test_a_parameter_made_in_the_forward_is_an_error():
    class Lazy(nnx.Module):
        def __call__(self, x):
            self.w = nnx.Param(jnp.ones((x.shape[-1], 10)))  # would be redrawn, never trained
            return x @ self.w[...]

    with pytest.raises(LayerError, match=r"layer 0 \(Lazy\) writes Param w in its forward"):
        _pipe([Lazy()], 1, 1)


def test_first_layer_that_cannot_take_the_batch_names_its_shapes():
    layers = [nnx.Linear(30, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 10, rngs=nnx.Rngs(0))]
    with pytest.raises(LayerError, match=r"layer 0 \(Linear\) \(its parameters: bias float32\[16\], "
                                         r"kernel float32\[30, 16\]\) cannot take input "
                                         r"float32\[2, 20\] produced by the example"):
        _pipe(layers, 2, 2)


@pytest.mark.parametrize("bad,match", [
    (lambda: nnx.Linear, r"layer 0 is the class Linear, not a module; give an instance"),
    (lambda: nnx.eval_shape(lambda: nnx.Linear(20, 10, rngs=nnx.Rngs(0))),
     r"layer 0 \(Linear\) holds abstract parameters \(bias, kernel: no values\)"),
])
def test_a_module_without_values_is_an_error(bad, match):
    with pytest.raises(LayerError, match=match):
        _pipe([bad(), nnx.relu], 1, 1)


def test_one_module_listed_twice_is_an_error_and_a_shared_parameter_a_tie():
    shared = nnx.Linear(20, 20, rngs=nnx.Rngs(0))
    with pytest.raises(LayerError, match=r"layers 0 and 2 \(Linear\) are one module object"):
        _pipe([shared, nnx.relu, shared], 2, 2)
    tied = nnx.Linear(20, 20, rngs=nnx.Rngs(1))
    tied.kernel = shared.kernel
    pipe = _pipe([shared, tied], 2, 2)
    assert [t.holders for t in pipe.build.code.model.ties] == [((0, ("kernel",)),
                                                               (1, ("kernel",)))]


def test_writing_back_into_another_list_is_an_error():
    pipe = _pipe(_mlp(), 2, 2)
    values = pj.unstage(pipe.init())
    with pytest.raises(LayerError, match=r"takes the layer list the pipeline was given \(5 layers\), "
                                         r"got 2 layers"):
        pj.unstage(pipe.init(), into=_mlp()[:2])
    other = _mlp()
    other[0] = nnx.Linear(20, 8, rngs=nnx.Rngs(0))
    with pytest.raises(LayerError, match=r"layer 0 \(Linear\) has parameters .*float32\[20, 8\]"):
        pj.unstage(pipe.init(), into=other)
    assert len(values) == 5
