"""Tracing a layer list: shapes, parameter shapes and per-layer cost."""

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pipejax as pj
from pipejax import caches


def test_shapes_params_and_bytes_without_allocating():
    layers = [nn.Dense(16), nn.relu, lambda x: x.reshape(x.shape[0], 8, 2), nn.Conv(3, (3,)),
              lambda x: x.reshape(x.shape[0], -1), nn.Dense(5)]
    specs = pj.trace(layers, jnp.zeros((4, 20), jnp.float32))
    assert [s.name for s in specs] == ["Dense", "relu", "lambda", "Conv", "lambda", "Dense"]
    assert [s.output.shape for s in specs] == [(4, 16), (4, 16), (4, 8, 2), (4, 8, 3), (4, 24), (4, 5)]
    assert specs[0].variables["params"]["kernel"].shape == (20, 16)
    assert isinstance(specs[0].variables["params"]["kernel"], jax.ShapeDtypeStruct)
    assert specs[0].param_bytes == (20 * 16 + 16) * 4
    assert specs[1].param_bytes == 0 and specs[1].variables == {}
    assert specs[3].activation_bytes == 4 * 8 * 3 * 4


def test_flops_follow_the_matrix_sizes():
    specs = pj.trace([nn.Dense(64), nn.Dense(256)], jnp.zeros((8, 32)))
    # forward + backward of a dense layer is about 3 matrix products: 6·B·in·out FLOPs
    for spec, (n_in, n_out) in zip(specs, [(32, 64), (64, 256)]):
        assert spec.flops == pytest.approx(6 * 8 * n_in * n_out, rel=0.2)
    assert specs[1].cost == specs[1].flops


def test_equal_layers_on_equal_shapes_are_measured_once(monkeypatch):
    """Within a trace and across traces of one process (pj.search traces a list
    many times); a layer that holds its values (NNX) is kept without them."""
    tracing = importlib.import_module("pipejax.trace")  # pj.trace is the function

    calls = []
    measure = tracing._flops
    monkeypatch.setattr(tracing, "_flops", lambda *a: calls.append(a[0].name) or measure(*a))
    pj.clear_caches()  # what other tests traced in this process is forgotten
    lin = nnx.Linear(24, 24, rngs=nnx.Rngs(0))
    layers = [nn.Dense(24), nn.Dense(24), lin, nn.Dense(24, use_bias=False)]
    first = pj.trace(layers, jnp.zeros((4, 24)))
    assert calls == ["Dense", "Linear", "Dense"]  # the second Dense(24) equals the first
    again = pj.trace(layers + [nn.Dense(24)], jnp.zeros((4, 24)))
    assert calls == ["Dense", "Linear", "Dense"]
    assert [s.flops for s in again] == [s.flops for s in first] + [first[0].flops]
    [linear] = [kept[0] for (kept, _), _ in caches.ANALYSES if kept[0].name == "Linear"]
    assert linear.module is None and not [x for x in jax.tree.leaves(caches.ANALYSES)
                                          if isinstance(x, jax.Array)]  # no value kept alive
    pj.trace(layers[:1], jnp.zeros((8, 24)))  # other shapes: measured
    assert calls[-1] == "Dense" and len(calls) == 4


def test_the_process_memories_are_counted_and_cleared():
    """pj.cache_sizes names what a pipeline's build remembered; pj.clear_caches
    forgets it, and a pipeline built again initializes to the same values."""
    pj.clear_caches()
    build = lambda: pj.pipeline(pj.models.mlp(depth=2, width=16), loss=pj.losses.cross_entropy,
                                example=jnp.zeros((2, 40)), stages=2, microbatches=2)
    pipe = build()
    first = pj.unstage(pipe.init(jax.random.key(0)))
    pj.schedules.ring_capacities(pipe.schedule)
    pipe.trainer(optax.sgd(0.1)).memory()
    built = {k: n for k, n in pj.cache_sizes().items() if k != "generators"}  # pj.generate's
    assert all(n > 0 for n in built.values()), built
    pj.clear_caches()
    assert set(pj.cache_sizes().values()) == {0}
    again = pj.unstage(build().init(jax.random.key(0)))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), first, again)


def test_measured_time_is_the_cost_when_asked():
    specs = pj.trace([nn.Dense(64), nn.relu], jnp.zeros((8, 32)), cost="time")
    assert all(s.seconds is not None and s.seconds > 0 for s in specs)
    assert specs[0].cost == specs[0].seconds


def test_integer_inputs_are_traced():
    specs = pj.trace([nn.Embed(10, 4), lambda x: x.reshape(x.shape[0], -1), nn.Dense(3)],
                     jnp.zeros((2, 5), jnp.int32))
    assert specs[0].output.shape == (2, 5, 4) and specs[2].output.shape == (2, 3)
