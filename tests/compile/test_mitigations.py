"""The executor runs each stage's forward on its weight forecast: pipelined
backpropagation with every mitigation equals a per-micro-batch reference that
keeps every weight version and writes the forecasts and spike compensation
out by hand, and equals `pj.simulate` on the same micro-batches."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from tests.reference import rel_err, train_async

LR, MOMENTUM = 0.05, 0.9
# Small enough to compile fast, deep enough for four stages of two layers.
LAYERS = pj.models.mlp(3, 16, 10)


def _hand_sgdm(a: float = 1.0, b: float = 0.0) -> optax.GradientTransformation:
    """v ← m·v + g; w ← w − η·(a·v + b·g), the state named like optax.trace's."""
    def init(params):
        return optax.TraceState(trace=jax.tree.map(jnp.zeros_like, params))

    def update(g, state, params=None):
        v = jax.tree.map(lambda v, g: MOMENTUM * v + g, state.trace, g)
        return jax.tree.map(lambda v, g: -LR * (a * v + b * g), v, g), optax.TraceState(trace=v)

    return optax.GradientTransformation(init, update)


def _reference(name: str, infos: list) -> tuple[list, list]:
    """Per stage: the hand-written optimizer and forecast (T_f, T_b, form, η)."""
    opts, predict = [], []
    for s in infos:
        D = s.delay
        sc = name in ("sc", "lwp+sc")
        # SC_D: a = m^D, b = Σ_{j<D} m^j (Kosson et al. 2020, eq. 14)
        opts.append(_hand_sgdm(MOMENTUM ** D, sum(MOMENTUM ** j for j in range(D))) if sc
                    else _hand_sgdm())
        predict.append({"spectrain": (s.forward_horizon, s.backward_horizon, "velocity", LR),
                        "lwp": (D, 0, "difference", None),
                        "lwp+sc": (D, 0, "difference", None)}.get(name, (0, 0, "difference", None)))
    return opts, predict


@pytest.mark.parametrize("name", pj.transforms.MITIGATIONS)
def test_pb_with_each_mitigation_equals_the_versioned_reference_and_simulate(name):
    mit = pj.transforms.mitigation(name, LR, momentum=MOMENTUM)
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


def test_the_forecast_changes_the_forward():
    """LWP_D differs from no mitigation (the test above is not vacuous)."""
    run = lambda name: train_async("pb", 4, 2, False, ref_opt=_hand_sgdm(), layers=LAYERS,
                                   opt=pj.transforms.mitigation(name, LR).optimizer)
    none, lwp = run("none"), run("lwp")
    assert rel_err(lwp.losses, none.losses) > 1e-3
