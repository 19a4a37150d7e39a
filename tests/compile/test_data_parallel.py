"""Data × pipeline parallelism on the real mesh: R pipeline replicas over the
data axes, combined by a data rule around each stage's optimizer.

SSGD (the default) equals one pipeline on the whole batch, synchronous and
asynchronous; the decentralized rules equal their equations written out
over per-replica sequential gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.cases import fast_and_slow
from tests.reference import batch, rel_err, sequential_value_and_grad, train_async

T = pj.transforms
# Dropout-free: each replica draws its own dropout keys, which a pipeline on
# the whole batch cannot reproduce.
LAYERS = pj.models.mlp(3, 16, 10)
MB, M, LR = 2, 4, 0.1


def _pipe(K, M, mesh=None, schedule="gpipe"):
    return pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule, mesh=mesh)


@pytest.mark.parametrize("schedule", fast_and_slow(["gpipe", "1f1b"], fast=["1f1b"]))
def test_ssgd_on_2x4_equals_one_pipeline_on_the_whole_batch(schedule):
    whole, dp = _pipe(4, 2 * M, schedule=schedule), _pipe(4, M, pj.make_mesh(4, 2), schedule)
    x, y = batch(2 * M * MB)
    params = whole.init(jax.random.key(0))
    loss, grads = whole.value_and_grad(params, (x, y))
    dp_loss, dp_grads = dp.value_and_grad(dp.init(jax.random.key(0)), (x, y))
    assert abs(float(dp_loss) - float(loss)) <= 1e-5 * abs(float(loss))
    assert rel_err(pj.unstage(dp_grads), pj.unstage(grads)) < 1e-5

    opt = optax.sgd(LR, momentum=0.9)
    a, b = whole.trainer(opt), dp.trainer(opt)
    sa, sb = a.init(params), b.init(dp.init(jax.random.key(0)))
    for s in range(3):
        x, y = batch(2 * M * MB, seed=s)
        sa, ma = a.step(sa, (x, y))
        sb, mb = b.step(sb, (x, y))
        assert abs(float(mb["loss"]) - float(ma["loss"])) <= 1e-5 * abs(float(ma["loss"]))
    assert "consensus_distance" not in mb  # SSGD replicas never differ
    assert rel_err(pj.unstage(sb), pj.unstage(sa)) < 1e-5
    for u, v in zip(jax.tree.leaves(pj.unstage(sb, 0)), jax.tree.leaves(pj.unstage(sb, 1))):
        np.testing.assert_array_equal(u, v)


def test_pb_with_ssgd_equals_the_versioned_reference_on_the_whole_batch():
    run = train_async("pb", K=4, M=4, stash=False, layers=LAYERS, R=2)
    assert rel_err(run.losses, run.ref_losses) < 1e-5
    assert rel_err(pj.unstage(run.state), run.ref) < 1e-5


def _hand(rule: str, theta, grads, step, nodes, local):
    """One step of eq 7 (H-ADPSGD) on replica-stacked weights, written out:
    (hadpsgd) gradients averaged inside each node, θ ← ½(θ + θ_nb) − η·g with
    the neighbour on the ring of nodes, left on even steps, right on odd ones."""
    R = nodes * local
    node, lane = np.divmod(np.arange(R), local)
    if rule == "hadpsgd":
        grads = [jax.tree.map(lambda *g: sum(g) / local, *[grads[j] for j in range(R)
                                                          if node[j] == node[r]])
                 for r in range(R)]
    shift = 1 if step % 2 == 0 else -1
    nb = [int(np.flatnonzero((node == (node[r] - shift) % nodes) & (lane == lane[r]))[0])
          for r in range(R)]
    return [jax.tree.map(lambda p, q, g: 0.5 * (p + q) - LR * g, theta[r], theta[nb[r]],
                         grads[r]) for r in range(R)]


@pytest.mark.parametrize("rule,mesh", [("adpsgd", (2, 4, 1)), ("hadpsgd", (2, 4, 2))])
def test_decentralized_rules_equal_equation_7_written_out(rule, mesh):
    K, R, nodes = mesh
    pipe = _pipe(K, M, pj.make_mesh(K, R, nodes))
    trainer = pipe.trainer(optax.sgd(LR), rule=T.adpsgd() if rule == "adpsgd" else T.hadpsgd())
    params = pipe.init(jax.random.key(0))
    state = trainer.init(params)
    vg = sequential_value_and_grad(LAYERS, M)
    theta = [pj.unstage(params)] * R
    for s in range(3):
        x, y = batch(R * M * MB, seed=s)
        state, metrics = trainer.step(state, (x, y))
        parts = zip(x.reshape(R, M * MB, 20), y.reshape(R, M * MB))
        grads = [vg(theta[r], xr, yr, jax.random.key(0))[1] for r, (xr, yr) in enumerate(parts)]
        ring = R if rule == "adpsgd" else nodes  # adpsgd: every replica is its own node
        theta = _hand(rule, theta, grads, s, ring, R // ring)
        for r in range(R):
            assert rel_err(pj.unstage(state, r), theta[r]) < 1e-5, (s, r)
        flat = np.stack([np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)]) for t in theta])
        spread = np.sqrt(np.mean(np.sum((flat - flat.mean(0)) ** 2, axis=1)))
        np.testing.assert_allclose(metrics["consensus_distance"], spread, rtol=1e-4)
    mean = jax.tree.map(lambda *t: sum(t) / R, *theta)
    assert rel_err(pj.unstage(state), mean) < 1e-5  # unstage's default: the replicas' mean


def test_asynchronous_replicas_with_alpha_zero_train_apart():
    """PB with elastic averaging at alpha = 0 (the rule's collectives run,
    masked, at every tick): each replica equals a PB pipeline of its own."""
    R, K = 2, 4
    dp, one = _pipe(K, M, pj.make_mesh(K, R), "pb"), _pipe(K, M, schedule="pb")
    opt = optax.sgd(LR, momentum=0.9)
    a = dp.trainer(opt, rule=T.elastic(alpha=0.0, every=1))
    sa = a.init(dp.init(jax.random.key(0)))
    alone = [one.trainer(opt) for _ in range(R)]
    solo = [t.init(one.init(jax.random.key(0))) for t in alone]
    for s in range(3):
        x, y = batch(R * M * MB, seed=s)
        sa, ma = a.step(sa, (x, y))
        for r in range(R):
            solo[r], _ = alone[r].step(solo[r], (x[r * M * MB:(r + 1) * M * MB],
                                                 y[r * M * MB:(r + 1) * M * MB]))
    assert float(ma["consensus_distance"]) > 0
    for r in range(R):
        assert rel_err(pj.unstage(sa, r), pj.unstage(solo[r])) < 1e-6
