"""Independent references the tests compare the pipeline against."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj


def heterogeneous_layers() -> list:
    """Dense, activations, a Conv over a 1-D signal with reshape/flatten,
    LayerNorm, Dropout and a Dense of another width: every stage boundary of
    a split of this list has its own shape."""
    return [
        nn.Dense(32), nn.relu,
        lambda x: x.reshape(x.shape[0], 16, 2),
        nn.Conv(4, (3,)), jnp.tanh,
        lambda x: x.reshape(x.shape[0], -1),
        nn.LayerNorm(), nn.Dense(48), nn.gelu,
        nn.Dropout(0.25),
        nn.Dense(24), nn.relu,
        nn.Dense(10),
    ]


def sequential_loss(layers, variables, x, y, M, key, loss=pj.losses.cross_entropy):
    """Mean over M micro-batches of the micro-batch loss, run layer after layer
    on one device; micro-batch m uses fold_in(key, m), layer i fold_in(., i)."""
    mb = x.shape[0] // M
    total = 0.0
    for m in range(M):
        out = pj.apply_layers(layers, variables, x[m * mb:(m + 1) * mb], jax.random.fold_in(key, m))
        total = total + loss(out, y[m * mb:(m + 1) * mb])
    return total / M


def rel_err(a, b) -> float:
    """Largest per-leaf max|a − b| / max|b| over two pytrees of equal structure."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la, "trees differ in size or are empty"
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q))) /
                     max(float(np.max(np.abs(np.asarray(q)))), 1e-30)) for p, q in zip(la, lb))


def batch(n: int, features: int = 20, classes: int = 10, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (n, features), jnp.float32),
            jax.random.randint(ky, (n,), 0, classes))
