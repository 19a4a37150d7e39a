"""The Adam-era corrections against their formulas written out in numpy, three
updates each: SC_D on Adam's first moment, torch's NAdam (the Nesterov
method's optimizer), PipeOptim's forecast with Adam's own direction; and the
recipes that build them from `AdamW`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError

T = pj.transforms
B1, B2, EPS, LR, WD = 0.8, 0.95, 1e-3, 0.1, 0.2
STAGE = pj.StageInfo(stage=1, stages=4, delay=3, forward_horizon=4, backward_horizon=1)
W0 = np.array([1.0, -2.0, 0.5])
GRADS = [np.array([1.0, 0.5, -1.0]), np.array([-0.5, 2.0, 0.0]), np.array([3.0, -1.0, 0.5])]


def _run(opt: optax.GradientTransformation) -> list:
    """(update, weights, forecast) after each of the three updates from W0."""
    w, state, out = jnp.asarray(W0), opt.init(jnp.asarray(W0)), []
    for g in GRADS:
        u, state = opt.update(jnp.asarray(g), state, w)
        w = optax.apply_updates(w, u)
        out.append(tuple(np.asarray(a) for a in (
            u, w, T.forecast(w, state) if T.has_forecast(state) else w)))
    return out


def _moments():
    """Adam's m_t, v_t for t = 1, 2, 3 (m ← β1·m + (1 − β1)·g, v likewise with g²)."""
    m, v, out = 0 * W0, 0 * W0, []
    for g in GRADS:
        m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
        out.append((g, m, v))
    return out


def _adam_weights(s: int, t: int) -> float:
    """The weight Adam's update t gives gradient s: (1 − β1)·β1^(t−s)/(1 − β1^t)."""
    return (1 - B1) * B1 ** (t - s) / (1 - B1 ** t)


def test_spike_compensation_on_adam_by_hand():
    """SC_D moves every gradient's contributions D updates earlier: update t
    gives gradient s < t the weight Adam's update t + D gives it, and the new
    gradient the weights of Adam's updates t .. t + D."""
    D = 3
    expected = []
    for t, (_, _, v) in enumerate(_moments(), start=1):
        numerator = sum(_adam_weights(s, t + D) * GRADS[s - 1] for s in range(1, t)) + sum(
            _adam_weights(t, t + k) for k in range(D + 1)) * GRADS[t - 1]
        expected.append(numerator / (np.sqrt(v / (1 - B2 ** t)) + EPS))
    got = [u for u, _, _ in _run(T.adam_spike_compensation(D, b1=B1, b2=B2, eps=EPS))]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # a constant gradient moves each weight by one rate a step, as Adam's, from the first
    constant = T.adam_spike_compensation(14, b1=0.9, b2=0.95, eps=0.0)
    state, g = constant.init(jnp.zeros(2)), jnp.array([0.5, -2.0])
    first, state = constant.update(g, state)
    assert float(jnp.max(first)) < 3  # the catch-up of the first update is bounded
    for _ in range(200):
        u, state = constant.update(g, state)
    np.testing.assert_allclose(u, jnp.sign(g), rtol=1e-5)
    with pytest.raises(ConfigError, match="must be a whole number of updates"):
        T.adam_spike_compensation(3, scale=1.5)


def test_spike_compensation_on_adam_is_adam_at_0_and_nadam_at_1():
    for D, plain in ((0, optax.scale_by_adam(B1, B2, EPS)),
                     (1, optax.scale_by_adam(B1, B2, EPS, nesterov=True))):
        chex.assert_trees_all_close(_run(T.adam_spike_compensation(D, b1=B1, b2=B2, eps=EPS)),
                                    _run(plain), rtol=1e-6)


# torch 2.13.0 NAdam([W0], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD,
# momentum_decay=0.004, decoupled_weight_decay=True): the weights after GRADS · 3
TORCH_NADAM = [[0.8705816113, -2.0693091887, 0.5994183887],
               [0.895367063, -2.1386677875, 0.5972176972],
               [0.7614313357, -2.0533395875, 0.5367482849],
               [0.6927129001, -2.047280112, 0.6197709135],
               [0.6862641328, -2.110540043, 0.6181446817],
               [0.555954868, -2.0314042934, 0.561162837],
               [0.4886481307, -2.0256893184, 0.6477103522],
               [0.4803727453, -2.0918016861, 0.6461962342],
               [0.3509945018, -2.0146759665, 0.5893098146]]


def test_nadam_is_torchs():
    adam = T.AdamW(B1, B2, EPS, weight_decay=WD)
    w, opt = jnp.asarray(W0), adam.nadam(LR, 0.004)
    state, got = opt.init(w), []
    for g in GRADS * 3:
        u, state = opt.update(jnp.asarray(g), state, w)
        w = optax.apply_updates(w, u)
        got.append(w)
    np.testing.assert_allclose(got, TORCH_NADAM, rtol=1e-5)


def test_nadam_by_hand():
    """torch.optim.NAdam: μ_t = β1·(1 − ½·0.96^(tψ)), Π_t = Π μ_i, decoupled decay."""
    psi, w, product, expected = 0.004, W0.copy(), 1.0, []
    for t, (g, m, v) in enumerate(_moments(), start=1):
        mu_t, mu_next = (B1 * (1 - 0.5 * 0.96 ** (s * psi)) for s in (t, t + 1))
        product *= mu_t
        d = np.sqrt(v / (1 - B2 ** t)) + EPS
        w = w * (1 - LR * WD) - LR * (1 - mu_t) / (1 - product) * g / d \
            - LR * mu_next / (1 - product * mu_next) * m / d
        expected.append(w)
    adam = T.AdamW(B1, B2, EPS, weight_decay=WD)
    got = [w for _, w, _ in _run(adam.nadam(LR, psi))]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    mit = T.nesterov(LR, optimizer=adam, momentum_decay=psi)
    assert mit.weight_stashing and mit.momentum == B1
    np.testing.assert_allclose([w for _, w, _ in _run(mit.optimizer(STAGE))], expected, rtol=1e-6)


def test_pipeoptim_forecasts_with_adams_direction_by_hand():
    """ŵ = w − η·D·m̂/(√v̂ + ε), the weight decay in the update but not in ΔW."""
    adam, rate = T.AdamW(B1, B2, EPS, weight_decay=WD), optax.linear_schedule(LR, LR / 2, 2)
    w, expected = W0.copy(), []
    for t, (g, m, v) in enumerate(_moments(), start=1):
        direction = (m / (1 - B1 ** t)) / (np.sqrt(v / (1 - B2 ** t)) + EPS)
        eta = float(rate(t - 1))  # η of update t
        w = w - eta * (direction + WD * w)
        expected.append(w - eta * STAGE.delay * direction)
    mit = T.pipeoptim(rate, optimizer=adam)
    assert not mit.weight_stashing
    forecasts = [f for _, _, f in _run(mit.optimizer(STAGE))]
    np.testing.assert_allclose(forecasts, expected, rtol=1e-6)
    by_name = T.mitigation("pipeoptim", rate, optimizer=adam).optimizer(STAGE)
    chex.assert_trees_all_equal(_run(by_name), _run(mit.optimizer(STAGE)))


def test_adamw_is_optax_adamw_and_the_adam_recipes_are_their_chains():
    mask = lambda p: jax.tree.map(lambda a: a.ndim >= 1, p)
    adam = T.AdamW(B1, B2, EPS, weight_decay=WD, mask=mask)
    chex.assert_trees_all_close(_run(adam(LR)), _run(optax.adamw(LR, B1, B2, EPS,
                                                                  weight_decay=WD, mask=mask)))
    sc = optax.chain(T.adam_spike_compensation(3, b1=B1, b2=B2, eps=EPS),
                     optax.add_decayed_weights(WD, mask), optax.scale_by_learning_rate(LR))
    cases = {"sc": sc, "lwp+sc": optax.chain(sc, T.weight_forecast(3.0)),
             "none": adam(LR), "lwp": optax.chain(adam(LR), T.weight_forecast(3.0))}
    for name, by_hand in cases.items():
        mit = T.mitigation(name, LR, optimizer=adam)
        chex.assert_trees_all_close(_run(mit.optimizer(STAGE)), _run(by_hand), rtol=1e-6)
    # pipeoptim on SGDM is LWP_D in the velocity form (its ΔW is the momentum trace)
    chex.assert_trees_all_equal(_run(T.pipeoptim(LR, optimizer="momentum").optimizer(STAGE)),
                                _run(T.lwp(LR).optimizer(STAGE)))


def test_the_adam_recipes_name_what_is_wrong():
    with pytest.raises(ConfigError, match="'nesterov' is NAdam on stashed weights; give "
                                          "optimizer=pj.transforms.AdamW"):
        T.mitigation("nesterov", LR, optimizer="momentum")
    with pytest.raises(ConfigError, match="mitigation 'spectrain' forecasts with a momentum "
                                          "trace, which Adam does not have"):
        T.mitigation("spectrain", LR, optimizer=T.AdamW())
    with pytest.raises(ConfigError, match="b1=1.0, b2=0.95 must lie in"):
        T.AdamW(b1=1.0, b2=0.95)(LR)
    with pytest.raises(ConfigError, match="'nesterov' takes no momentum, reference, batch"):
        T.mitigation("nesterov", LR, momentum=0.9, reference=(0.1, 0.9, 128), batch=1)
    with pytest.raises(ConfigError, match="'pipeoptim' takes no form, sweep"):
        T.mitigation("pipeoptim", LR, form="velocity", sweep=True)
    with pytest.raises(ConfigError, match="momentum=0.5 on AdamW, whose momentum is its b1"):
        T.no_mitigation(LR, momentum=0.5, optimizer="adam")
    with pytest.raises(ConfigError, match="eps=-1 and weight_decay=0.0 be >= 0"):
        T.pipeoptim(LR, optimizer=T.AdamW(eps=-1))
    assert T.sc(LR, optimizer=T.AdamW(b1=0.95)).momentum == 0.95


def test_nesterov_by_default_is_the_papers():
    """NAdam with β1 0.99, β2 0.999, decay 0.01 (Ajanthan et al.'s run.bash), stashing."""
    mit = T.mitigation("nesterov", LR)
    assert mit.weight_stashing and mit.momentum == 0.99
    chex.assert_trees_all_equal(_run(mit.optimizer(STAGE)), _run(
        T.AdamW(0.99, 0.999, 1e-8, weight_decay=0.01).nadam(LR)))
