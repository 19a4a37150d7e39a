"""One function per mitigation recipe: each gives the updates and forecasts of
the chain its formula describes, written out with the public transforms, and
exactly those of `mitigation(name, ...)`; a recipe rejects what it does not
take."""

import inspect

import chex
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError

T = pj.transforms
M = 0.8
RATE = optax.piecewise_constant_schedule(0.1, {2: 0.5})  # a rate that changes within the steps
STAGE = pj.StageInfo(stage=1, stages=4, delay=3, forward_horizon=4, backward_horizon=1)
W0 = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5, 0.0, 3.0])}
GRADS = [{"w": jnp.array([1.0, 0.5]), "b": jnp.array([-1.0, 2.0, 0.25])},
         {"w": jnp.array([-0.5, 2.0]), "b": jnp.array([0.0, 1.0, -1.0])},
         {"w": jnp.array([3.0, -1.0]), "b": jnp.array([0.5, 0.5, 0.5])}]


def _steps(opt: optax.GradientTransformation) -> list:
    """(update, weights, forecast) after each of three updates from W0."""
    w, state, out = W0, opt.init(W0), []
    for g in GRADS:
        u, state = opt.update(g, state, w)
        w = optax.apply_updates(w, u)
        out.append((u, w, T.forecast(w, state) if T.has_forecast(state) else w))
    return out


def _sgdm(rate=RATE) -> optax.GradientTransformation:
    return optax.chain(optax.trace(M), optax.scale_by_learning_rate(rate))


def _sc() -> optax.GradientTransformation:  # SC_D, a = m^D, b = (1 − m^D)/(1 − m)
    a, b = M ** 3, (1 - M ** 3) / (1 - M)
    return optax.chain(T.spike_compensation(M, 0, a=a, b=b), optax.scale_by_learning_rate(RATE))


def _velocity(horizon) -> optax.GradientTransformation:  # ŵ = w − η·T·v
    return T.weight_forecast(horizon, form="velocity", learning_rate=RATE)


# name: (the recipe, its settings, the chain written out for STAGE: D = 3, T_f = 4, T_b = 1)
CASES = {
    "none": (T.no_mitigation, {}, _sgdm()),
    "stash": (T.stash, {}, _sgdm()),
    "spectrain": (T.spectrain, {}, optax.chain(_sgdm(), _velocity((4.0, 1.0)))),
    "lwp": (T.lwp, {}, optax.chain(_sgdm(), _velocity(3.0))),
    "sc": (T.sc, {}, _sc()),
    "lwp+sc": (T.lwp_sc, {}, optax.chain(_sc(), _velocity(3.0))),
    "pipemare": (T.pipemare, {"warmup_steps": 4}, _sgdm(T.pipemare_lr(RATE, 3, 4))),
    "lwp, difference form": (T.lwp, {"form": "difference"},
                             optax.chain(_sgdm(), T.weight_forecast(3.0))),
    "lwp on adam": (T.lwp, {"optimizer": "adam"},
                    optax.chain(optax.adam(RATE), T.weight_forecast(3.0))),
    "pipemare on adam": (T.pipemare, {"optimizer": "adam", "warmup_steps": 4},
                         optax.adam(T.pipemare_lr(RATE, 3, 4))),
    "lwp+sc on adam": (T.lwp_sc, {"optimizer": "adam"}, optax.chain(
        T.adam_spike_compensation(3), optax.add_decayed_weights(0.0),
        optax.scale_by_learning_rate(RATE), T.weight_forecast(3.0))),
    "ef": (T.ef, {}, optax.chain(_sgdm(), T.error_feedback(3.0))),
    "ef on adam": (T.ef, {"optimizer": "adam", "horizon_scale": 0.5},
                   optax.chain(optax.adam(RATE), T.error_feedback(1.5))),
}


@pytest.mark.parametrize("case", CASES)
def test_each_recipe_is_its_chain_and_its_name(case):
    recipe, settings, by_hand = CASES[case]
    name = next(name for name, r in T.RECIPES.items() if r.build is recipe)
    momentum = {} if settings.get("optimizer") == "adam" else {"momentum": M}  # Adam's: β1
    mit = recipe(RATE, **momentum, **settings)
    assert mit == (mit.optimizer, name == "stash", RATE, momentum.get("momentum", 0.9))
    steps = _steps(mit.optimizer(STAGE))
    chex.assert_trees_all_close(steps, _steps(by_hand), rtol=1e-6, atol=1e-7)
    looked_up = T.mitigation(name, RATE, **momentum, **settings)
    chex.assert_trees_all_equal(steps, _steps(looked_up.optimizer(STAGE)))
    assert looked_up[1:] == mit[1:]


@pytest.mark.parametrize("recipe", [T.no_mitigation, T.stash, T.spectrain, T.lwp, T.sc, T.lwp_sc])
def test_the_sweep_chain_gives_the_recipes_updates(recipe):
    name = next(name for name, r in T.RECIPES.items() if r.build is recipe)
    swept = recipe(RATE, momentum=M, sweep=True)
    chex.assert_trees_all_close(_steps(swept.optimizer(STAGE)),
                                _steps(recipe(RATE, momentum=M).optimizer(STAGE)), rtol=1e-6)
    chex.assert_trees_all_equal(_steps(swept.optimizer(STAGE)), _steps(
        T.mitigation(name, RATE, momentum=M, sweep=True).optimizer(STAGE)))


def test_a_named_recipe_states_what_its_function_takes():
    """The registry's settings and default optimizer are the function's own."""
    for name, recipe in T.RECIPES.items():
        params = inspect.signature(recipe.build).parameters
        assert set(params) == recipe.takes, name
        assert recipe.optimizer == (params["optimizer"].default if "optimizer" in params
                                    else "momentum"), name


def test_reference_scaling_is_the_same_through_the_recipe():
    mit = T.lwp_sc(reference=(0.1, 0.9, 128), batch=1)
    assert mit[1:] == T.mitigation("lwp+sc", reference=(0.1, 0.9, 128), batch=1)[1:]
    assert (mit.learning_rate, mit.momentum) == T.scale_hyperparams(0.1, 0.9, 128, 1)


def test_a_recipe_rejects_what_it_does_not_take():
    with pytest.raises(TypeError, match="warmup_steps"):
        T.lwp(0.1, warmup_steps=10)
    with pytest.raises(TypeError, match="optimizer"):
        T.spectrain(0.1, optimizer="adam")  # it forecasts with the momentum trace
    with pytest.raises(TypeError, match="form"):
        T.no_mitigation(0.1, form="velocity")
    with pytest.raises(TypeError, match="sweep"):
        T.pipemare(0.1, warmup_steps=10, sweep=True)
    with pytest.raises(TypeError, match="warmup_steps"):
        T.pipemare(0.1)
    with pytest.raises(ConfigError, match="warmup_steps=K_warm >= 1, not 0"):
        T.pipemare(0.1, warmup_steps=0)
    with pytest.raises(ConfigError, match="use form='difference' with Adam"):
        T.lwp(0.1, optimizer="adam", form="velocity")
    with pytest.raises(ConfigError, match=r"sweep=True\) builds the SGDM mitigations in the "
                                          "velocity form; 'lwp\\+sc' on 'momentum' with "
                                          "form='difference'"):
        T.lwp_sc(0.1, form="difference", sweep=True)


def test_the_lookup_checks_what_it_leaves_out():
    with pytest.raises(ConfigError, match="unknown mitigation 'sgd'; choose one of none, stash, "
                                          "spectrain, lwp, sc, lwp\\+sc, pipemare, pipeoptim, "
                                          "nesterov, ef"):
        T.mitigation("sgd", 0.1)
    with pytest.raises(ConfigError, match="with Adam use none, stash, lwp, sc, lwp\\+sc, "
                                          "pipemare, pipeoptim, nesterov, ef"):
        T.mitigation("spectrain", 0.1, optimizer="adam")
    with pytest.raises(ConfigError, match="mitigation optimizer 'sgd'; use 'momentum', 'adam', "
                                          "pj.transforms.AdamW.* or pj.transforms.Muon"):
        T.mitigation("none", 0.1, optimizer="sgd")
    with pytest.raises(ConfigError, match="form='fast'; use 'velocity' or 'difference'"):
        T.mitigation("none", 0.1, form="fast")  # `none` takes no form, yet it is checked
    with pytest.raises(ConfigError, match="mitigation 'pipemare' takes no sweep; leave it out"):
        T.mitigation("pipemare", 0.1, warmup_steps=10, sweep=True)
    # settings a name does not use are left out, as the CLI passes them to every name
    assert T.mitigation("none", 0.1, horizon_scale=2.0, warmup_steps=5).learning_rate == 0.1
