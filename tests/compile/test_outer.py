"""The outer pieces of an update, each alone on packed buffers inside shard_map."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import pipejax as pj
from pipejax.compile.outer import Outer, all_finite, clip_by_global_norm
from pipejax.compile.spmd import lead, local, params, shard
from pipejax.errors import ConfigError
from pipejax.mesh import STAGE

K = 4


STAGED = P(STAGE)  # a [K, ...] buffer, row k on stage k


def _buffers(seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(K, 6)), jnp.float32),
            jnp.asarray(rng.normal(size=(K, 3)), jnp.float32))


def test_clip_by_global_norm_over_the_stages_equals_optax_on_the_whole_model():
    mesh, grads = pj.make_mesh(K), _buffers()
    clip = shard(lambda g: lead(clip_by_global_norm(local(g), 1.5)), mesh, (STAGED,), STAGED)
    want, _ = optax.clip_by_global_norm(1.5).update(grads, optax.EmptyState())
    got = clip(grads)
    assert float(optax.tree.norm(grads)) > 1.5
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clip_over_the_pieces_of_sharded_stages_equals_optax_on_the_whole_model():
    mesh, grads = pj.make_mesh(2, fsdp=2), _buffers()[:1]  # a [K, 6] slot in 2 pieces a stage
    whole = tuple(g[:2] for g in grads)
    clip = shard(lambda g: lead(clip_by_global_norm(local(g), 1.5, model=("stage", "fsdp"))),
                 mesh, (params(mesh, replicas=False),), params(mesh, replicas=False))
    want, _ = optax.clip_by_global_norm(1.5).update(whole, optax.EmptyState())
    assert float(optax.tree.norm(whole)) > 1.5
    for a, b in zip(clip(whole), want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_stage_the_guard_drops_adds_nothing_to_the_norm():
    mesh, grads = pj.make_mesh(K), _buffers()
    ok = jnp.arange(K) != 2  # stage 2's gradient is dropped
    clip = shard(lambda g, o: lead(clip_by_global_norm(local(g), 1.5, o[0])), mesh,
                 (STAGED, STAGED), STAGED)
    kept = tuple(jnp.where(ok[:, None], g, 0.0) for g in grads)
    want, _ = optax.clip_by_global_norm(1.5).update(kept, optax.EmptyState())
    got = clip(grads, ok)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a)[ok], np.asarray(b)[ok], rtol=1e-6)


def test_all_finite_sees_one_stage_or_every_stage_by_scope():
    mesh = pj.make_mesh(K)
    grads = _buffers()
    grads = (grads[0].at[1, 3].set(jnp.nan), grads[1])
    check = lambda scope: shard(lambda g: lead(all_finite(local(g), scope)), mesh, (STAGED,),
                                STAGED)
    assert check(())(grads).tolist() == [True, False, True, True]
    assert check((STAGE,))(grads).tolist() == [False] * K


def test_the_rule_before_half_averages_the_replicas():
    mesh = pj.make_mesh(2, 2)  # ("data", "stage")
    outer = Outer(pj.transforms.ssgd())
    spec = params(mesh)
    grads = tuple(jnp.arange(4 * n, dtype=jnp.float32).reshape(4, n) for n in (3, 2))

    def body(g):
        g = local(g)
        out, _ = outer.before(g, outer.init(g), g)
        return lead(out)

    got = shard(body, mesh, (spec,), spec)(grads)
    for a, g in zip(got, grads):  # rows r·K + k: the mean over r of stage k's rows
        mean = (g[:2] + g[2:]) / 2
        np.testing.assert_allclose(a, jnp.concatenate([mean, mean]))


def test_outer_rejects_a_clip_norm_that_is_not_positive():
    with pytest.raises(ConfigError, match="clip_norm=0"):
        Outer(clip_norm=0)
