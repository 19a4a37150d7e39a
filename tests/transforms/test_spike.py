"""spike_compensation against values worked out by hand, and its reductions."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.reference import transformed

GRADS = [{"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 4.0])}, {"w": jnp.array([-3.0, 1.0])}]


def test_sc_d_by_hand():
    # m = 0.5, D = 2: a = m^D = 0.25, b = (1 − 0.25) / 0.5 = 1.5
    assert pj.transforms.coefficients(0.5, 2) == (0.25, 1.5)
    out = transformed(pj.transforms.spike_compensation(0.5, delay=2), GRADS)
    # v1 = g1 = [1, −2]: u1 = 0.25·v1 + 1.5·g1 = [1.75, −3.5]
    # v2 = 0.5·v1 + g2 = [1, 3]: u2 = [0.25 + 0.75, 0.75 + 6] = [1, 6.75]
    # v3 = 0.5·v2 + g3 = [−2.5, 2.5]: u3 = [−0.625 − 4.5, 0.625 + 1.5] = [−5.125, 2.125]
    chex.assert_trees_all_close(out, [{"w": jnp.array([1.75, -3.5])}, {"w": jnp.array([1.0, 6.75])},
                                      {"w": jnp.array([-5.125, 2.125])}])


def test_scale_two_is_sc_2d_and_a_b_override():
    sc = pj.transforms.spike_compensation
    chex.assert_trees_all_close(transformed(sc(0.9, 3, scale=2.0), GRADS),
                                transformed(sc(0.9, 6), GRADS))
    # a = 0, b = 1: the raw gradient
    chex.assert_trees_all_close(transformed(sc(0.9, 3, a=0.0, b=1.0), GRADS),
                                GRADS)


def test_delay_zero_is_momentum_and_delay_one_is_nesterov():
    chex.assert_trees_all_close(transformed(pj.transforms.spike_compensation(0.9, 0), GRADS),
                                transformed(optax.trace(0.9), GRADS))
    chex.assert_trees_all_close(transformed(pj.transforms.spike_compensation(0.9, 1), GRADS),
                                transformed(optax.trace(0.9, nesterov=True), GRADS), rtol=1e-6)


def test_jit_and_inside_a_chain():
    opt = optax.chain(pj.transforms.spike_compensation(0.9, 4), optax.scale(-0.1))
    params = {"w": jnp.ones(2)}
    step = jax.jit(opt.update)
    u, state = step(GRADS[0], opt.init(params), params)
    a, b = pj.transforms.coefficients(0.9, 4)
    chex.assert_trees_all_close(u, {"w": -0.1 * (a + b) * GRADS[0]["w"]})
    assert isinstance(state[0], pj.transforms.SpikeCompensationState)


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="momentum=1.5"):
        pj.transforms.spike_compensation(1.5, 2)
    with pytest.raises(ConfigError, match="delay=-1"):
        pj.transforms.spike_compensation(0.9, -1)


def test_hyperparameters_injected_as_arrays():
    """With optax.inject_hyperparams the numbers live in the state: the same
    updates as the plain transform, and a changed value takes effect."""
    a, b = pj.transforms.coefficients(0.9, 3)
    plain = pj.transforms.spike_compensation(0.9, 3)
    injected = optax.inject_hyperparams(pj.transforms.spike_compensation)(
        momentum=0.9, delay=3, a=a, b=b)
    w, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 1.0])}
    s1, s2 = plain.init(w), injected.init(w)
    for _ in range(3):
        u1, s1 = plain.update(g, s1, w)
        u2, s2 = jax.jit(injected.update)(g, s2, w)
        chex.assert_trees_all_close(u1, u2, rtol=1e-6)
    s2.hyperparams["b"] = jnp.asarray(0.0)  # now a·v only: v = 1 + 0.9 + 0.81 + 0.729 times g
    u, _ = injected.update(g, s2, w)
    chex.assert_trees_all_close(u["w"], a * 3.439 * g["w"], rtol=1e-5)
    with pytest.raises(ConfigError, match="give a and b"):
        optax.inject_hyperparams(pj.transforms.spike_compensation)(momentum=0.9, delay=3).init(w)
