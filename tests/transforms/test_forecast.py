"""weight_forecast / forecast against values worked out by hand."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError

W0 = {"w": jnp.array([1.0, 2.0])}
G1, G2 = {"w": jnp.array([1.0, -1.0])}, {"w": jnp.array([2.0, 0.0])}


def _two_steps(opt):
    w, state = W0, opt.init(W0)
    for g in (G1, G2):
        u, state = opt.update(g, state, w)
        w = optax.apply_updates(w, u)
    return w, state


def test_difference_form_by_hand():
    # SGD η = 0.1: w1 = [0.9, 2.1], w2 = [0.7, 2.1]; ŵ = w2 + 3·(w2 − w1) = [0.1, 2.1]
    opt = optax.chain(optax.sgd(0.1), pj.transforms.weight_forecast(3))
    w, state = _two_steps(opt)
    chex.assert_trees_all_close(w, {"w": jnp.array([0.7, 2.1])})
    chex.assert_trees_all_close(pj.transforms.forecast(w, state), {"w": jnp.array([0.1, 2.1])},
                                atol=1e-6)
    chex.assert_trees_all_close(pj.transforms.forecast(w, state, horizon=1.0),
                                {"w": jnp.array([0.5, 2.1])}, atol=1e-6)


def test_velocity_form_by_hand():
    # m = 0.5, η = 0.1: v1 = [1, −1], v2 = [2.5, −0.5]; w2 = [1 − 0.1 − 0.25, 2 + 0.1 + 0.05]
    # ŵ = w2 − η·T·v2 with T = 2: [0.65 − 0.5, 2.15 + 0.1]
    opt = optax.chain(optax.trace(0.5), optax.scale(-0.1),
                      pj.transforms.weight_forecast(2, form="velocity", learning_rate=0.1))
    w, state = _two_steps(opt)
    chex.assert_trees_all_close(w, {"w": jnp.array([0.65, 2.15])}, atol=1e-6)
    chex.assert_trees_all_close(pj.transforms.forecast(w, state), {"w": jnp.array([0.15, 2.25])},
                                atol=1e-6)


def test_forms_agree_for_sgdm_and_differ_under_spike_compensation():
    diff = lambda head: optax.chain(head, optax.scale(-0.1), pj.transforms.weight_forecast(4))
    vel = lambda head: optax.chain(head, optax.scale(-0.1), pj.transforms.weight_forecast(
        4, form="velocity", learning_rate=0.1))
    for head, equal in ((optax.trace(0.9), True), (pj.transforms.spike_compensation(0.9, 4), False)):
        (wd, sd), (wv, sv) = _two_steps(diff(head)), _two_steps(vel(head))
        same = jnp.allclose(pj.transforms.forecast(wd, sd)["w"], pj.transforms.forecast(wv, sv)["w"],
                            atol=1e-6)
        assert bool(same) == equal


def _ones(opt, steps):
    """w and the chain's state after each of `steps` updates with gradient 1 from w = 0."""
    w, state, out = {"w": jnp.zeros(())}, None, []
    state = opt.init(w)
    for _ in range(steps):
        u, state = opt.update({"w": jnp.ones(())}, state, w)
        w = optax.apply_updates(w, u)
        out.append((w, state))
    return out


def test_velocity_form_follows_a_schedule_by_hand():
    # η = 1, 1, then 0.1; m = 0.5; g = 1: v = 1, 1.5, 1.75; w = −1, −2.5, −2.675.
    # ŵ = w − η_last·T·v with η_last the rate of the update just applied, T = 2:
    # −1 − 2·1 = −3;  −2.5 − 2·1.5 = −5.5;  −2.675 − 0.1·2·1.75 = −3.025
    eta = optax.piecewise_constant_schedule(1.0, {2: 0.1})
    opt = optax.chain(optax.trace(0.5), optax.scale_by_learning_rate(eta),
                      pj.transforms.weight_forecast(2, form="velocity", learning_rate=eta))
    steps = _ones(opt, 3)
    chex.assert_trees_all_close([w["w"] for w, _ in steps], [-1.0, -2.5, -2.675], atol=1e-6)
    chex.assert_trees_all_close([pj.transforms.forecast(w, s)["w"] for w, s in steps],
                                [-3.0, -5.5, -3.025], atol=1e-6)
    # the difference form extrapolates the same last update: equal for SGDM
    diff = optax.chain(optax.trace(0.5), optax.scale_by_learning_rate(eta),
                       pj.transforms.weight_forecast(2))
    chex.assert_trees_all_close([pj.transforms.forecast(w, s)["w"] for w, s in _ones(diff, 3)],
                                [-3.0, -5.5, -3.025], atol=1e-6)


def test_lwp_sc_mitigation_is_the_velocity_form_by_hand():
    # SC_D with m = 0.5, D = 2: a = 0.25, b = 1.5; η = 1, 1, 0.1; g = 1; v = 1, 1.5, 1.75.
    # updates −(0.25·1 + 1.5), −(0.25·1.5 + 1.5), −0.1·(0.25·1.75 + 1.5):
    # w = −1.75, −3.625, −3.81875; velocity forecast T = D = 2:
    # −1.75 − 2·1 = −3.75;  −3.625 − 2·1.5 = −6.625;  −3.81875 − 0.1·2·1.75 = −4.16875
    eta = optax.piecewise_constant_schedule(1.0, {2: 0.1})
    info = pj.StageInfo(0, 2, 2, 2, 0)
    make = lambda **kw: pj.transforms.mitigation("lwp+sc", eta, momentum=0.5, **kw).optimizer(info)
    steps = _ones(make(), 3)
    chex.assert_trees_all_close([w["w"] for w, _ in steps], [-1.75, -3.625, -3.81875], atol=1e-6)
    chex.assert_trees_all_close([pj.transforms.forecast(w, s)["w"] for w, s in steps],
                                [-3.75, -6.625, -4.16875], atol=1e-6)
    # form="difference": w + 2·(last update): −3.625 − 2·1.875 = −7.375
    w, s = _ones(make(form="difference"), 2)[-1]
    chex.assert_trees_all_close(pj.transforms.forecast(w, s)["w"], -7.375, atol=1e-6)


def test_backward_horizon_is_known_from_the_structure():
    w = {"w": jnp.zeros(())}
    lwp = pj.transforms.weight_forecast(3)
    spectrain = pj.transforms.weight_forecast((3, 1), form="velocity", learning_rate=0.1)
    assert not pj.transforms.forecasts_backward(jax.eval_shape(lwp.init, w))
    assert pj.transforms.forecasts_backward(jax.eval_shape(spectrain.init, w))
    assert float(pj.transforms.forecast_horizon(lwp.init(w), backward=True)) == 0.0


def test_horizon_zero_and_pass_through():
    opt = optax.chain(optax.adam(0.1), pj.transforms.weight_forecast(0))
    w, state = _two_steps(opt)
    chex.assert_trees_all_equal(pj.transforms.forecast(w, state), w)
    w_plain, _ = _two_steps(optax.adam(0.1))
    chex.assert_trees_all_close(w, w_plain)  # updates pass through unchanged


def test_spectrain_horizons_come_from_the_stage():
    info = pj.schedules.pipedream(4, 4).stage_info(1)  # s_f = ⌊1/2⌋ + 4 − 1 − 1 = 2, s_b = 0
    opt = optax.chain(optax.sgd(0.1), pj.transforms.weight_forecast("spectrain", stage=info))
    state = jax.jit(opt.init)(W0)
    assert float(pj.transforms.forecast_horizon(state)) == 2.0
    assert float(pj.transforms.forecast_horizon(state, backward=True)) == 0.0


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="learning_rate"):
        pj.transforms.weight_forecast(2, form="velocity")
    with pytest.raises(ConfigError, match="stage=s"):
        pj.transforms.weight_forecast("spectrain")
    with pytest.raises(ConfigError, match="form="):
        pj.transforms.weight_forecast(2, form="adam")
    with pytest.raises(ConfigError, match="0 weight_forecast"):
        pj.transforms.forecast(W0, optax.sgd(0.1).init(W0))
    opt = optax.chain(optax.adam(0.1), pj.transforms.weight_forecast(2, form="velocity",
                                                                      learning_rate=0.1))
    with pytest.raises(ConfigError, match="needs one velocity in the chain"):
        pj.transforms.forecast(W0, opt.init(W0))


def test_horizons_and_rate_injected_as_arrays():
    # velocity form, T = (2, 0) as arrays: the backward horizon stays in the state
    make = lambda horizon, backward, rate: optax.chain(
        optax.trace(0.5), optax.scale_by_learning_rate(rate),
        pj.transforms.weight_forecast((horizon, backward), form="velocity", learning_rate=rate))
    injected = optax.inject_hyperparams(make)(horizon=2.0, backward=0.0, rate=1.0)
    steps = _ones(injected, 2)
    state = steps[-1][1]
    assert pj.transforms.forecasts_backward(state)
    chex.assert_trees_all_close([pj.transforms.forecast(w, s)["w"] for w, s in steps],
                                [-3.0, -5.5], atol=1e-6)  # as in the schedule test by hand
