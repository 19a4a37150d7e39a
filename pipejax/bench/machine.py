"""Where the benchmarks run: meshes of real or simulated devices, and batches."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

import pipejax as pj

FEATURES, CLASSES = 40, 10


@contextlib.contextmanager
def on_devices(K: int) -> Iterator[jax.sharding.Mesh]:
    """A mesh of K devices of the default backend, or of simulated CPU
    devices if it has fewer (then tracing and costing run on the CPU too)."""
    if len(jax.devices()) >= K:
        yield pj.make_mesh(K, devices=jax.devices()[:K])
        return
    cpus = jax.devices("cpu")
    with jax.default_device(cpus[0]):
        yield pj.make_mesh(K, devices=cpus[:K])


def batch(n: int, shape: tuple = (FEATURES,)) -> tuple:
    """n random examples of `shape` and their labels."""
    return (jax.random.normal(jax.random.key(1), (n, *shape)),
            jax.random.randint(jax.random.key(2), (n,), 0, CLASSES))
