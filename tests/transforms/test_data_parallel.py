"""The data-parallel rules on their own, in a plain shard_map over 8 replicas:
each against its equation written out with numpy (H-ADPSGD eqs 6–7,
MXNET-MPI eqs 2–3), and the properties the issue names (mean preserved,
the ring's spectral gap, alpha = 0)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pipejax as pj
from pipejax.errors import ConfigError

T = pj.transforms
N = 8  # replicas on the axis "data"
MESH = Mesh(np.array(jax.devices()[:N]), ("data",))
SPEC = P("data")


def _steps(transform, params, updates, steps):
    """Run `transform` `steps` times on replica-stacked `params` [N, d] with
    fixed per-replica `updates` [N, d]; returns the [steps + 1, N, d] params."""
    def body(p, u):
        p, u = p[0], u[0]
        state = transform.init(p)
        trail = [p]
        for _ in range(steps):
            out, state = transform.update(u, state, p)
            p = optax.apply_updates(p, out)
            trail.append(p)
        return jnp.stack(trail)[None]

    run = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(SPEC, SPEC), out_specs=SPEC,
                                check_vma=False))
    return np.asarray(run(params, updates)).transpose(1, 0, 2)


def _spread(theta: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.sum((theta - theta.mean(0)) ** 2, axis=-1))))


def test_mean_gradients_is_the_large_batch_gradient():
    w = jnp.arange(6.0).reshape(3, 2) / 10
    x = jax.random.normal(jax.random.key(0), (N * 4, 3))
    loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)

    def body(x):
        g = jax.grad(loss)(w, x)
        return T.mean_gradients("data").update(g, optax.EmptyState())[0][None]

    # check_vma=False: per-replica gradients (with it, JAX sums the gradient
    # of a replicated w over the axis by itself)
    got = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=SPEC, out_specs=SPEC,
                                check_vma=False))(x)
    want = jax.grad(loss)(w, x)
    for r in range(N):
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-7)


def test_gossip_is_equation_7_with_alternating_neighbours():
    """Θ_{k+1} = Θ_k·T_k − α·g: T_k averages with the left neighbour on even
    steps, the right one on odd steps; the update is taken before averaging."""
    rng = np.random.default_rng(0)
    theta, u = rng.normal(size=(N, 5)).astype(np.float32), rng.normal(size=(N, 5)).astype(np.float32)
    got = _steps(T.gossip("data"), theta, u, 4)
    want = theta
    for k in range(4):
        other = np.roll(want, 1 if k % 2 == 0 else -1, axis=0)  # row i gets i−1, then i+1
        want = 0.5 * (want + other) + u
        np.testing.assert_allclose(got[k + 1], want, rtol=1e-5, atol=1e-5)


def test_gossip_preserves_the_mean_and_contracts_at_the_spectral_gap():
    rng = np.random.default_rng(1)
    theta = rng.normal(size=(N, 16)).astype(np.float32)
    trail = _steps(T.gossip("data"), theta, np.zeros_like(theta), 60)
    drift = np.abs(trail.mean(1) - theta.mean(0)).max()
    assert drift < 1e-6, drift
    spread = np.array([_spread(t) for t in trail])
    assert spread[-1] < 0.02 * spread[0]
    # Slowest modes j = 1, N − 1 of T = (I + S^±1)/2 shrink by |cos(π/N)| a step.
    rate = (spread[-1] / spread[40]) ** (1 / 20)
    assert abs(rate - np.cos(np.pi / N)) < 1e-3, (rate, np.cos(np.pi / N))
    # A pure slowest mode shrinks at exactly that rate from the first step.
    mode = np.cos(2 * np.pi * np.arange(N) / N + 0.3)[:, None] * rng.normal(size=(1, 16))
    trail = _steps(T.gossip("data"), mode.astype(np.float32), np.zeros_like(theta), 10)
    ratio = np.array([_spread(t) for t in trail]) / _spread(mode)
    np.testing.assert_allclose(ratio, np.cos(np.pi / N) ** np.arange(11), rtol=1e-5)


def test_elastic_average_by_hand():
    """Every 2nd step: w ← w − α(w − w̃), w̃ ← w̃ + α·Σ_i(w_i − w̃) with w
    the weights after the local step (MXNET-MPI eqs 2–3, synchronous form)."""
    rng = np.random.default_rng(2)
    theta, u = rng.normal(size=(N, 3)).astype(np.float32), rng.normal(size=(N, 3)).astype(np.float32)
    alpha = 0.05
    got = _steps(T.elastic_average("data", alpha, every=2), theta, u, 4)
    w, center = theta.copy(), theta.copy()
    for k in range(1, 5):
        w = w + u
        if k % 2 == 0:
            diff = w - center
            w, center = w - alpha * diff, center + alpha * diff.sum(0)
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-5)


def test_elastic_average_with_alpha_zero_is_independent_replicas():
    rng = np.random.default_rng(3)
    theta, u = rng.normal(size=(N, 3)).astype(np.float32), rng.normal(size=(N, 3)).astype(np.float32)
    got = _steps(T.elastic_average("data", 0.0, every=1), theta, u, 3)
    np.testing.assert_array_equal(got[-1], _steps(optax.identity(), theta, u, 3)[-1])


def test_consensus_distance_by_hand():
    rng = np.random.default_rng(4)
    theta = rng.normal(size=(N, 7)).astype(np.float32)
    run = jax.jit(jax.shard_map(lambda p: T.consensus_distance(p[0], "data"), mesh=MESH,
                                in_specs=SPEC, out_specs=P(), check_vma=False))
    np.testing.assert_allclose(run(theta), _spread(theta), rtol=1e-5)
    assert float(run(np.tile(theta[:1], (N, 1)))) == 0.0


def test_rule_arguments_are_checked():
    with pytest.raises(ConfigError, match="single mesh axis"):
        T.gossip(("node", "local"))
    with pytest.raises(ConfigError, match="topology 'star'"):
        T.gossip("data", topology="star")
    with pytest.raises(ConfigError, match=r"alpha=1.5.*\[0, 1\]"):
        T.elastic_average("data", 1.5, 4)
    with pytest.raises(ConfigError, match="every=0"):
        T.elastic_average("data", 0.1, 0)
