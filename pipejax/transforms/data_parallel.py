"""Data-parallel rules over named mesh axes, as optax transformations.

Replicas of a model (one per index of the mesh's data axes) combine their
training by a rule of H-ADPSGD (papers/h-adpsgd.txt §2–4) or MXNET-MPI
(papers/mxnet-mpi.txt §2.2, §5):

- `mean_gradients(axis)`: SSGD, the all-reduce mean of the gradients (H-ADPSGD eq 6);
- `gossip(axis)`: DPSGD/ADPSGD (H-ADPSGD eq 7), each replica averages its
  weights with one ring neighbour, left and right alternately;
- `elastic_average(axis, alpha, every)`: elastic averaging with a center
  variable (MXNET-MPI eqs 2–3, synchronous form).

Each is a `GradientTransformation` that works inside any `shard_map` binding
its axis, and element-wise, so it is exact on a pipeline's packed buffers.
`mean_gradients` acts on gradients, before the optimizer; `gossip` and
`elastic_average` on the optimizer's final update, given the parameters,
after it. A pipeline trainer takes them as a `DataRule` (before, after) and
not inside the per-stage optax chain, because that chain runs in the
per-stage `lax.switch`, where collectives must not sit: the executor
runs the rule's two halves around the switch, on the packed buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax

from pipejax.errors import ConfigError
from pipejax.mesh import DATA, LOCAL, NODE

Axes = str | tuple[str, ...]


def _names(axis: Axes) -> tuple[str, ...]:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if not names or not all(isinstance(a, str) for a in names):
        raise ConfigError(f"axis={axis!r}: name a mesh axis, or a tuple of mesh axes")
    return names


def mean_gradients(axis: Axes) -> optax.GradientTransformation:
    """SSGD (H-ADPSGD eq 6): replace each gradient by its mean over `axis`
    (an all-reduce, `lax.pmean`), so every replica applies the same update."""
    names = _names(axis)

    def update(updates, state, params=None):
        del params
        return lax.pmean(updates, names), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class GossipState(NamedTuple):
    count: jax.Array  # int32: averaging steps taken; even steps pair with the left neighbour


def _neighbour(tree: Any, axis: str, count: jax.Array) -> Any:
    """The left (count even) or right (count odd) ring neighbour's `tree`.

    Both messages are sent and one is kept: a collective under a condition
    deadlocks XLA CPU when devices disagree on it (measured, jax 0.10), and
    in an asynchronous pipeline the stages' counts differ.
    """
    n = lax.axis_size(axis)
    left = lax.ppermute(tree, axis, [(i, (i + 1) % n) for i in range(n)])
    if n == 2:
        return left
    right = lax.ppermute(tree, axis, [(i, (i - 1) % n) for i in range(n)])
    return jax.tree.map(lambda a, b: jnp.where(count % 2 == 0, a, b), left, right)


def gossip(axis: str, topology: str = "ring") -> optax.GradientTransformation:
    """DPSGD/ADPSGD (H-ADPSGD eq 7): Θ_{k+1} = Θ_k·T_k − α·g(Θ_k).

    The last transform of a chain: it takes the optimizer's final update u
    and returns u + ½(θ_j − θ), so the new weights are ½(θ + θ_j) + u — the
    average with one ring neighbour j (left on even steps, right on odd ones)
    plus the step of the gradient taken at θ, before averaging. T_k is doubly
    stochastic, so the replicas' mean moves by the mean update only; with zero
    updates the spread shrinks by |cos(π/n)| per step on a ring of n.
    """
    if not isinstance(axis, str):
        raise ConfigError(f"gossip runs on one ring, axis={axis!r}; name a single mesh axis")
    if topology != "ring":
        raise ConfigError(f"unknown gossip topology {topology!r}; the supported one is 'ring'")

    def update(updates, state, params=None):
        if params is None:
            raise ConfigError("gossip averages weights: call its update with params")
        if lax.axis_size(axis) == 1:
            return updates, GossipState(state.count + 1)
        other = _neighbour(params, axis, state.count)
        updates = jax.tree.map(lambda u, p, q: u + 0.5 * (q - p), updates, params, other)
        return updates, GossipState(state.count + 1)

    return optax.GradientTransformation(lambda params: GossipState(jnp.zeros((), jnp.int32)),
                                        update)


class ElasticState(NamedTuple):
    center: Any  # the center variable w̃, like the parameters
    count: jax.Array  # int32: local steps taken


def elastic_average(axis: Axes, alpha: float, every: int) -> optax.GradientTransformation:
    """Elastic averaging (MXNET-MPI eqs 2–3, synchronous form over p clients).

    The last transform of a chain. Every `every`-th step, with w = θ + u the
    client's weights after its local step: w ← w − α(w − w̃) (eq 3) and
    w̃ ← w̃ + α·Σ_i (w_i − w̃) over the clients on `axis` (eq 2). The center
    starts at the initial parameters; other steps leave both alone. The sum
    over the clients is computed at every step and used on averaging steps:
    a collective under a condition deadlocks XLA CPU when devices disagree on
    it (the stages of an asynchronous pipeline do). alpha = 0: independent clients.
    """
    names = _names(axis)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"alpha={alpha}: the elastic moving rate lies in [0, 1] (MXNET-MPI "
                          "uses 1/p or less for p clients)")
    if not isinstance(every, int) or every < 1:
        raise ConfigError(f"every={every!r}: average every n >= 1 steps (the paper's INTERVAL, 64)")

    def init(params):
        return ElasticState(jax.tree.map(jnp.asarray, params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ConfigError("elastic_average moves weights: call its update with params")
        count = state.count + 1

        now = count % every == 0
        diff = jax.tree.map(lambda p, u, c: p + u - c, params, updates, state.center)
        total = lax.psum(diff, names)
        updates = jax.tree.map(lambda u, d: jnp.where(now, u - alpha * d, u), updates, diff)
        center = jax.tree.map(lambda c, t: jnp.where(now, c + alpha * t, c), state.center, total)
        return updates, ElasticState(center, count)

    return optax.GradientTransformation(init, update)


def consensus_distance(params: Any, axis: Axes, over: Sequence[str] = ()) -> jax.Array:
    """Spread of the replicas' weights: sqrt((1/n)·Σ_i ‖θ_i − θ̄‖²) over the n
    replicas on `axis`; `over` names axes whose devices hold other parts of
    the same model (a pipeline's "stage"), summed too. Exactly 0 when all
    agree: it measures the deviations from replica 0 (θ_i − θ_0, exact zeros
    then), not from a rounded mean."""
    names = _names(axis)
    n, first = lax.psum(1, names), lax.axis_index(names) == 0
    sq = jnp.float32(0)
    for p in jax.tree.leaves(params):
        d = (p - lax.psum(jnp.where(first, p, jnp.zeros_like(p)), names)).astype(jnp.float32)
        sq += jnp.sum(jnp.square(d - lax.pmean(d, names)))
    return jnp.sqrt(lax.psum(sq, (*names, *over)) / n)


class DataRule(NamedTuple):
    """How pipeline replicas on the data axes combine their training: `before`
    acts on each stage's gradients before its optimizer, `after` on the
    optimizer's final update (given the parameters) after it."""

    name: str
    axes: tuple[str, ...]  # every mesh axis the rule communicates over
    before: optax.GradientTransformation
    after: optax.GradientTransformation
    decentralized: bool  # replicas' weights may differ: the trainer reports their spread


def ssgd(axes: Axes = DATA) -> DataRule:
    """Synchronous SGD: the gradient mean over `axes`; replicas stay identical."""
    return DataRule("ssgd", _names(axes), mean_gradients(axes), optax.identity(), False)


def adpsgd(axis: str = DATA) -> DataRule:
    """Decentralized SGD: gossip with a ring neighbour on `axis` after every step."""
    return DataRule("adpsgd", _names(axis), optax.identity(), gossip(axis), True)


def hadpsgd(node: str = NODE, local: str = LOCAL) -> DataRule:
    """H-ADPSGD (§4): SSGD inside a node (`mean_gradients(local)`), then the
    optimizer, then gossip between the nodes' super-learners."""
    return DataRule("hadpsgd", (node, local), mean_gradients(local), gossip(node), True)


def elastic(axis: str = DATA, alpha: float = 0.1, every: int = 8,
            local: str | None = None) -> DataRule:
    """Elastic averaging between the clients on `axis`; with `local`, the
    workers of a client average their gradients first (MXNET-MPI §5)."""
    before = mean_gradients(local) if local else optax.identity()
    axes = (axis, local) if local else (axis,)
    return DataRule("elastic", axes, before, elastic_average(axis, alpha, every), True)


RULES = ("ssgd", "adpsgd", "hadpsgd", "elastic")
