"""`layer_list` wraps each kind of layer once into the `Layer` interface, and
the adapters run as Flax and the functions themselves do."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import pipejax as pj
from pipejax.errors import LayerError
from pipejax.layers import FunctionLayer, LinenLayer, NnxLayer, layer_list


def test_each_kind_gets_its_adapter_and_adapters_pass_through():
    dense, linear = nn.Dense(4), nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    wrapped = layer_list([dense, jnp.tanh, linear, lambda x: x])
    assert [type(layer) for layer in wrapped] == [LinenLayer, FunctionLayer, NnxLayer,
                                                  FunctionLayer]
    assert [layer.name for layer in wrapped] == ["Dense", "tanh", "Linear", "lambda"]
    assert [layer.source for layer in wrapped][:3] == [dense, jnp.tanh, linear]
    assert all(a is b for a, b in zip(layer_list(wrapped), wrapped))


def test_adapters_compute_what_flax_and_the_function_compute():
    x, key = jnp.arange(6.0).reshape(2, 3), jax.random.key(1)
    dense, linear = layer_list([nn.Dense(4), nnx.Linear(3, 4, rngs=nnx.Rngs(0))])
    want = nn.Dense(4).init(key, x)
    chex.assert_trees_all_equal(dense.init(key, x), dict(want))
    chex.assert_trees_all_equal(dense.apply(want, x), nn.Dense(4).apply(want, x))
    assert dense.initial_values() is None
    chex.assert_trees_all_equal(linear.apply(linear.init(key, x), x), linear.source(x))
    chex.assert_trees_all_equal(linear.initial_values(), nnx.state(linear.source, nnx.Param))
    [tanh] = layer_list([jnp.tanh])
    assert tanh.init(key, x) == {} and tanh.initial_values() is None
    chex.assert_trees_all_equal(tanh.apply({}, x), jnp.tanh(x))


def test_same_layer_means_one_function_of_variables_and_input():
    f = lambda x: x  # noqa: E731
    a, b, c, g, h, n = layer_list([nn.Dense(4), nn.Dense(4), nn.Dense(5), f, f,
                                   nnx.Linear(3, 4, rngs=nnx.Rngs(0))])
    assert a.same(b) and not a.same(c) and g.same(h)
    assert not g.same(FunctionLayer(lambda x: x)) and not a.same(g) and not n.same(a)


def test_something_else_is_named():
    with pytest.raises(LayerError, match=r"layer 1 \(str\) is neither a Flax module nor a "
                                         r"callable"):
        layer_list([jnp.tanh, "relu"])


def test_pipeline_layers_are_the_objects_given():
    layers = [nn.Dense(8), nn.relu, nnx.Linear(8, 10, rngs=nnx.Rngs(0))]
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((2, 5)),
                       stages=1, microbatches=1)
    assert all(a is b for a, b in zip(pipe.layers, layers)) and len(pipe.layers) == 3
