"""Packing heterogeneous stage trees into equal slot buffers and back."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pipejax.packing import Packing


def test_roundtrip_of_heterogeneous_trees():
    rng = np.random.default_rng(0)
    trees = [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.arange(4, dtype=np.int32)},
        [rng.normal(size=(7,)).astype(np.float32), rng.normal(size=(2, 2)).astype(np.float32)],
        {},
    ]
    p = Packing.of(trees)
    assert p.stages == 3
    for k, tree in enumerate(trees):
        bufs = p.pack(k, tree)
        assert [b.size for b in bufs] == list(p.lengths)
        chex.assert_trees_all_equal(p.unpack(k, bufs), jax.tree.map(jnp.asarray, tree))
        assert p.used_bytes(k) == sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def test_identical_stages_share_slots_without_padding():
    tree = {"a": jnp.zeros((5, 5)), "b": jnp.zeros((5,))}
    p = Packing.of([tree, tree, tree])
    assert p.slot_bytes() == p.used_bytes(0) == 30 * 4
    assert [shape for _, shape in p.slots] == [(5, 5), (5,)]  # kept: no reshape to unpack


def test_largest_leaves_share_a_slot():
    p = Packing.of([[jnp.zeros(100), jnp.zeros(3)], [jnp.zeros(4), jnp.zeros(90)]])
    assert p.lengths == (100, 4) and [s for _, s in p.slots] == [(100,), (4,)]
