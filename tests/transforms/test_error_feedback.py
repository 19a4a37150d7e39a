"""error_feedback against values worked out by hand, its reductions, and the
quadratic figures its docstring quotes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.reference import transformed

UPDATES = [{"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 4.0])},
           {"w": jnp.array([-3.0, 1.0])}]


def test_error_feedback_by_hand():
    out = transformed(pj.transforms.error_feedback(), UPDATES)
    # the first passes; then u_t + (u_t − u_{t−1}) = 2·u_t − u_{t−1}
    chex.assert_trees_all_close(out, [{"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.0, 10.0])},
                                      {"w": jnp.array([-6.5, -2.0])}])
    half = transformed(pj.transforms.error_feedback(0.5), UPDATES)  # u_t + ½·(u_t − u_t−1)
    chex.assert_trees_all_close(half[2], {"w": jnp.array([-4.75, -0.5])})
    chex.assert_trees_all_close(transformed(pj.transforms.error_feedback(0.0), UPDATES), UPDATES)


def test_error_feedback_after_any_optimizer_and_under_jit():
    params = {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}
    grads = [jax.tree.map(lambda p, k=k: jnp.full_like(p, k + 1.0), params) for k in range(3)]
    for base in (optax.adamw(1e-2), optax.contrib.muon(1e-2)):
        fed = optax.chain(base, pj.transforms.error_feedback())
        plain, fed = transformed(base, grads), transformed(fed, grads)
        chex.assert_trees_all_close(fed[0], plain[0])
        chex.assert_trees_all_close(fed[2], jax.tree.map(lambda a, b: 2 * a - b, plain[2],
                                                         plain[1]), rtol=1e-6)
    step = jax.jit(pj.transforms.error_feedback().update)
    state = pj.transforms.error_feedback().init(params)
    _, state = step(grads[0], state, params)
    assert isinstance(state, pj.transforms.ErrorFeedbackState) and int(state.count) == 1


def _decay(eta_h: float, strength: float) -> tuple[float, float]:
    """(the per-step decay of the slow mode, the largest root's modulus) of
    SGD on h·w²/2 with the update one step late and error feedback of
    `strength`: w_{t+1} = w_t − ε·((1 + λ)·w_{t−1} − λ·w_{t−2})."""
    roots = np.roots([1.0, -1.0, eta_h * (1 + strength), -eta_h * strength])
    return float(1 - roots[np.argmin(abs(roots - 1))].real), float(max(abs(roots)))


def test_the_quadratic_figures_of_the_docstring():
    """λ = 1 is synchronous to second order in ε = η·h; it narrows the stable range."""
    assert _decay(0.1, 1.0)[0] == pytest.approx(0.0988, abs=5e-5)
    assert _decay(0.1, 0.0)[0] == pytest.approx(0.1127, abs=5e-5)
    for eps in (0.01, 0.03):  # the error: O(ε³) corrected, ε² not
        assert abs(_decay(eps, 1.0)[0] - eps) < 2 * eps ** 3 < eps ** 2 / 2 < \
            abs(_decay(eps, 0.0)[0] - eps)
    stable = lambda strength, eps: _decay(eps, strength)[1] < 1
    assert stable(0.0, 0.99) and not stable(0.0, 1.01)
    assert stable(1.0, 0.61) and not stable(1.0, 0.63)


def test_the_trajectory_follows_synchronous_sgd_closer():
    """On a quadratic, 2BW's delayed SGD with the correction ends nearer the
    synchronous weights than without it (the slow modes, ε = 0.03 and 0.12)."""
    h, eta = jnp.array([1.0, 4.0, 10.0]), 0.03

    def run(delay: int, strength: float):
        opt = optax.chain(optax.sgd(eta), pj.transforms.error_feedback(strength))
        w, previous, state, path = jnp.ones(3), jnp.ones(3), None, []
        state = opt.init(w)
        for _ in range(40):
            seen = previous if delay else w  # W(t − 1), W(−1) = W(0)
            u, state = opt.update(h * seen, state, w)
            previous, w = w, optax.apply_updates(w, u)
            path.append(w)
        return jnp.stack(path)

    sync = run(0, 0.0)[-1, :2]
    corrected, plain = (jnp.abs(run(1, strength)[-1, :2] - sync) for strength in (1.0, 0.0))
    assert jnp.all(corrected < plain / 5)


def test_bad_strength_is_named():
    with pytest.raises(ConfigError, match="strength=-1 must be >= 0"):
        pj.transforms.error_feedback(-1)


def test_muon_is_the_base_of_the_recipes_that_apply_its_own_update():
    """`ef`, `none` and `stash` on `pj.transforms.Muon` are optax's muon (with
    the feedback at λ = D); a recipe whose formula reads a momentum trace or
    Adam's moments, or a momentum given beside Muon's beta, is refused."""
    T = pj.transforms
    muon = T.Muon(beta=0.9, weight_decay=0.1)
    stage = pj.StageInfo(stage=0, stages=2, delay=2, forward_horizon=2, backward_horizon=0)
    params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
    grads = [jax.tree.map(lambda p, k=k: jnp.sin(jnp.arange(p.size, dtype=jnp.float32) + k)
                          .reshape(p.shape), params) for k in range(3)]
    by_hand = optax.contrib.muon(1e-2, beta=0.9, weight_decay=0.1, adam_b2=0.95,
                                 consistent_rms=0.2)
    for got, want in ((T.mitigation("ef", 1e-2, optimizer=muon).optimizer(stage),
                       optax.chain(by_hand, T.error_feedback(2.0))),
                      (T.mitigation("none", 1e-2, optimizer=muon).optimizer(stage), by_hand)):
        chex.assert_trees_all_close(transformed(got, grads), transformed(want, grads))
    assert T.stash(1e-2, optimizer=muon).weight_stashing
    for name in ("sc", "lwp", "lwp+sc", "pipeoptim", "spectrain"):
        with pytest.raises(ConfigError, match="Muon"):
            T.mitigation(name, 1e-2, optimizer=muon)
    with pytest.raises(ConfigError, match="Muon, whose momentum is its beta"):
        T.no_mitigation(1e-2, momentum=0.9, optimizer=muon)
    with pytest.raises(ConfigError, match="beta=1.0"):
        T.Muon(beta=1.0)(1e-2)
