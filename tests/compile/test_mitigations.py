"""The executor runs each stage's forward on its weight forecast: pipelined
backpropagation with every mitigation equals a per-micro-batch reference that
keeps every weight version and writes the forecasts, spike compensation,
PipeMare's rates and a decaying learning rate out by hand, and equals
`pj.simulate` on the same micro-batches."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.cases import fast_and_slow
from tests.reference import rel_err, train_async

LR, MOMENTUM, DECAY_AT, WARMUP = 0.05, 0.9, 6, 8
# Small enough to compile fast, deep enough for four stages of two layers.
LAYERS = pj.models.mlp(3, 16, 10)


def _rate(t: int) -> float:
    """The learning rate of update t: LR, then LR/10 from update DECAY_AT on."""
    return jnp.where(t < DECAY_AT, LR, LR / 10)


class _HandState(NamedTuple):
    trace: optax.Updates  # named like optax.trace's, for the velocity forecast
    count: jax.Array


def _hand_sgdm(a: float = 1.0, b: float = 0.0, rate=_rate) -> optax.GradientTransformation:
    """v ← m·v + g; w ← w − η_t·(a·v + b·g) at update t."""
    def init(params):
        return _HandState(jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32))

    def update(g, state, params=None):
        v = jax.tree.map(lambda v, g: MOMENTUM * v + g, state.trace, g)
        eta = rate(state.count)
        return (jax.tree.map(lambda v, g: -eta * (a * v + b * g), v, g),
                _HandState(v, state.count + 1))

    return optax.GradientTransformation(init, update)


def _hand_feedback(opt: optax.GradientTransformation, lam: float) -> optax.GradientTransformation:
    """`opt`'s update u_t, then u_t + λ·(u_t − u_{t−1}); the first unchanged."""
    def init(params):
        return opt.init(params), jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.int32)

    def update(g, state, params=None):
        inner, prev, count = state
        u, inner = opt.update(g, inner, params)
        out = jax.tree.map(lambda u, p: jnp.where(count == 0, u, u + lam * (u - p)), u, prev)
        return out, (inner, u, count + 1)

    return optax.GradientTransformation(init, update)


def _reference(name: str, infos: list) -> tuple[list, list]:
    """Per stage: the hand-written optimizer and forecast (T_f, T_b, form, η)."""
    opts, predict = [], []
    for s in infos:
        D = s.delay
        sc = name in ("sc", "lwp+sc")
        if name == "pipemare":  # α_t / τ^(1 − min(t / K_warm, 1)) (Yang et al. 2019, §3)
            opts.append(_hand_sgdm(rate=lambda t, D=D: _rate(t) / max(D, 1) ** (
                1 - jnp.minimum(t / WARMUP, 1))))
        else:  # SC_D: a = m^D, b = Σ_{j<D} m^j (Kosson et al. 2020, eq. 14)
            opts.append(_hand_sgdm(MOMENTUM ** D, sum(MOMENTUM ** j for j in range(D))) if sc
                        else _hand_sgdm())
        if name == "ef":  # error feedback at λ = D on the update (pipejax.transforms.ef)
            opts[-1] = _hand_feedback(opts[-1], D)
        # LWP in the velocity form, Kosson et al.'s default; η of the update that made the version
        predict.append({"spectrain": (s.forward_horizon, s.backward_horizon, "velocity", _rate),
                        "lwp": (D, 0, "velocity", _rate),
                        "lwp+sc": (D, 0, "velocity", _rate)}.get(name, (0, 0, "difference", None)))
    return opts, predict


# lwp and sc alone run with the slow tests (make test-all); make test runs them together, lwp+sc. The
# Adam-only recipes (pipeoptim, nesterov) meet the trainer in tests/test_delayed.py.
# Stashing runs in tests/compile/test_schedules.py; LWP_D and SC_D apart, and PipeMare's
# forecast, with the slow tests.
@pytest.mark.parametrize("name", fast_and_slow(
    [n for n in pj.transforms.MITIGATIONS if n not in ("pipeoptim", "nesterov")],
    fast=["lwp+sc"]))  # PB itself runs under each
def test_pb_with_each_mitigation_equals_the_versioned_reference_and_simulate(name):
    schedule = optax.piecewise_constant_schedule(LR, {DECAY_AT: 0.1})
    mit = pj.transforms.mitigation(name, schedule, momentum=MOMENTUM, warmup_steps=WARMUP
                                   if name == "pipemare" else None)
    infos = [pj.schedules.pb(4, 2).stage_info(k) for k in range(4)]
    ref_opt, predict = _reference(name, infos)
    run = train_async("pb", 4, 2, mit.weight_stashing, opt=mit.optimizer, ref_opt=ref_opt,
                      predict=predict, layers=LAYERS)
    assert rel_err(run.losses, run.ref_losses) < 1e-5
    assert rel_err(pj.unstage(run.state.params), run.ref) < 1e-5

    sim = pj.simulate(run.pipe.layers, loss=pj.losses.cross_entropy, optimizer=mit.optimizer,
                      split=run.pipe.plan.split, delays=run.pipe.schedule,
                      consistent=mit.weight_stashing)
    state, losses = sim.run(sim.init(pj.unstage(run.params), jax.random.key(9)), run.xs, run.ys)
    assert rel_err(losses, run.losses) < 1e-5
    assert rel_err(sim.params(state), pj.unstage(run.state.params)) < 1e-5


@pytest.mark.slow
def test_the_forecast_changes_the_forward():
    """LWP_D differs from no mitigation (the test above is not vacuous)."""
    run = lambda name: train_async("pb", 4, 2, False, ref_opt=_hand_sgdm(), layers=LAYERS,
                                   opt=pj.transforms.mitigation(name, LR).optimizer)
    none, lwp = run("none"), run("lwp")
    assert rel_err(lwp.losses, none.losses) > 1e-3


@pytest.mark.parametrize("schedule, why", [
    ("1f1b", "is synchronous"),
    ("2bw", "runs every op of a step on one weight version"),
])
def test_a_forecast_where_no_update_comes_between_is_an_error(schedule, why):
    """Synchronous and double-buffered tables have nothing to forecast; the
    trainer and `pj.simulate` refuse a forecast alike (the recipes' too)."""
    pipe = pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((2, 20)),
                       stages=2, microbatches=2, schedule=schedule)
    said = f"stage 0's optimizer ends in weight_forecast, but schedule '{schedule}' {why}"
    for opt in (optax.chain(optax.sgd(LR), pj.transforms.weight_forecast(2)),
                pj.transforms.mitigation("lwp", LR).optimizer):
        with pytest.raises(ConfigError, match=said):
            pipe.trainer(opt)
        sim = pj.simulate(LAYERS, loss=pj.losses.cross_entropy, optimizer=opt, split=2,
                          delays=schedule)
        with pytest.raises(ConfigError, match=said):
            sim.init(sim.variables(jax.random.key(0), jnp.zeros((2, 20))))


def test_forecast_after_a_collective_update():
    """Two replicas under SSGD: the update's mean runs outside the stage switch,
    and the forecast is made after it; equal to the reference on the joined
    micro-batches."""
    mit = pj.transforms.mitigation("lwp+sc", LR, momentum=MOMENTUM)
    delays = pj.schedules.pb(4, 2).delays
    ref_opt = [_hand_sgdm(MOMENTUM ** D, sum(MOMENTUM ** j for j in range(D)), rate=lambda t: LR)
               for D in delays]
    predict = [(D, 0, "velocity", LR) for D in delays]
    run = train_async("pb", 4, 2, False, opt=mit.optimizer, ref_opt=ref_opt, predict=predict,
                      layers=LAYERS, R=2)
    assert rel_err(run.losses, run.ref_losses) < 1e-5
    assert rel_err(pj.unstage(run.state.params), run.ref) < 1e-5
