"""What a trainer carries from one step to the next, typed.

`Staged` is a pytree packed into stage-sharded slot buffers `[K, length]`
(row k on stage k's device) together with the static `Packing` that reads
them back; parameters, gradients and per-stage optimizer states are all
`Staged`. A trainer on a mesh with data axes holds R replicas, `[R·K,
length]` (row r·K + k on replica r's stage k). `TrainState` is the whole state of a trainer; for an asynchronous
schedule its `inflight` part (`InFlight`: ring buffers, data rings and the
micro-batch counters) is allocated by `trainer.init`, so every step runs the
same compiled program. A synchronous trainer carries its table's ring
buffers as `scratch`: each step reads only slots it wrote, so what they hold
between steps means nothing (checkpoints skip them), and each step writes
into the last one's, donated, instead of filling new rings (the zoo GPT at
depth 14, K = 8, 1F1B without remat, `benchmarks/table_speed.py`: 1.25x the
plain jit's step filling new rings at every step, 0.93x carrying them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax.packing import Buffers, Packing
from pipejax.errors import ArgumentTypeError
from pipejax.layers.nnx import write_into


@jax.tree_util.register_pytree_node_class
class Staged:
    """Slot buffers `[R·K, length]` plus the static `Packing` that reads them;
    R, the replicas, is read off the buffers (1 for a pipeline's own parameters)."""

    def __init__(self, buffers: Buffers, packing: Packing):
        self.buffers = tuple(buffers)
        self.packing = packing

    @property
    def replicas(self) -> int:
        return np.shape(self.buffers[0])[0] // self.packing.stages if self.buffers else 1

    def tree_flatten(self):
        return self.buffers, (self.packing,)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children, *aux)

    def per_stage(self, replica: int | str = 0) -> list[Any]:
        """The K stage trees of one replica (or of the replicas' mean with
        replica="mean") as ordinary pytrees of arrays, copied to the host."""
        R, K = self.replicas, self.packing.stages
        if not self.buffers:  # a stateless optimizer's: nothing tells the replicas apart
            return [self.packing.unpack(k, ()) for k in range(K)]
        host = [host_array(b).reshape(R, K, *np.shape(b)[1:]) for b in self.buffers]
        if replica == "mean":
            # θ_0 + mean(θ_r − θ_0): exactly θ_0 when the replicas agree (SSGD).
            rows = [b[0] + np.mean(b - b[0], axis=0).astype(b.dtype) for b in host]
        elif isinstance(replica, (int, np.integer)) and 0 <= replica < R:
            rows = [b[replica] for b in host]
        else:
            raise ArgumentTypeError(f"replica={replica!r}; use 0 to {R - 1} or 'mean'")
        trees = [jax.tree.map(jax.numpy.asarray, self.packing.unpack(k, tuple(b[k] for b in rows)))
                 for k in range(K)]
        return _one_copy(trees, self.packing.tied)

    def __repr__(self) -> str:
        n = sum(int(np.prod(np.shape(b))) for b in self.buffers)
        return (f"Staged(stages={self.packing.stages}, replicas={self.replicas}, "
                f"slots={len(self.buffers)}, elements={n})")


def _one_copy(trees: list[Any], tied: tuple) -> list[Any]:
    """Stage trees with the leaves of each tied group (equal copies of one
    matrix, compile/ties.py) as one array, the first's."""
    if not tied:
        return trees
    flat = [jax.tree.flatten(t) for t in trees]
    leaves = [list(f[0]) for f in flat]
    for group in tied:
        (k0, n0), *rest = group
        for k, n in rest:
            leaves[k][n] = leaves[k0][n0]
    return [jax.tree.unflatten(treedef, ls) for (_, treedef), ls in zip(flat, leaves)]


def host_array(a: jax.Array) -> np.ndarray:
    """`a` on this host, gathered from the other processes if it spans them."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(jax.device_get(a))


class Rings(NamedTuple):
    """Ring buffers of one pipeline, slots `micro-batch mod capacity` (with
    v virtual stages, `(micro-batch · v + chunk) mod capacity`).

    The field order is the order of the scan's carry, and XLA's buffer
    assignment depends on it: with the inputs first, the GPipe step of a
    16 × 512 MLP (K = 4, M = 8) needed one more 64 KiB micro-batch buffer of
    temp memory (5,482,456 bytes against 5,411,544, measured).
    """

    grads: Buffers  # output gradients received, kept up to the backward
    kept: Buffers  # vjp residuals kept from the forward to the backward
    inputs: Buffers  # stage inputs received, kept up to their backward
    weights: Buffers  # with weight stashing: the weights each forward used; else ()
    bridge: Buffers = ()  # what a split backward's B filed for its W; () without W ops
    versions: Any = ()  # a double-buffered table's `versions.Versions`; () otherwise


class InFlight(NamedTuple):
    """An asynchronous pipeline between two steps: what is in flight, and where."""

    rings: Rings
    x: Any  # data ring [K, slots, mb, ...]: inputs of the micro-batches not yet finished
    y: Any  # the same for the targets
    base: jax.Array  # int32: id of the next micro-batch to feed (relative id 0 of the next period)
    start: jax.Array  # int32: ids below were never fed (before the first step, or a flush)
    fed: jax.Array  # int32: ids at and above are not fed yet


class TrainState(NamedTuple):
    """Everything `trainer.step` carries from one step to the next."""

    params: Staged
    opt_state: Staged  # per-stage optax states, packed like the parameters
    step: jax.Array  # int32 scalar: number of steps taken
    key: jax.Array  # base key; step t uses fold_in(key, t), micro-batch g fold_in(., g)
    inflight: InFlight | None  # asynchronous schedules; None for synchronous ones
    rule_state: Any = ()  # the data-parallel rule's (before, after) states, [R·K, ...] leaves
    scratch: Rings | tuple = ()  # a synchronous table's rings, [R·K·F, ...]; () asynchronous


def unstage(params: Staged | TrainState, replica: int | str = "mean",
            into: Any = None) -> list[Any]:
    """One variables tree per layer, in layer order: a Flax variables dict for
    a linen layer, an `nnx.State` of its parameters for an NNX layer, {} for
    a plain function.

    The result does not depend on how many stages the pipeline had, so it is
    the form to checkpoint, evaluate or re-stage with `pipe.stage`. Of a
    trainer's R replicas it gives their mean (the model decentralized rules
    converge to; exactly each replica's weights under SSGD), or `replica` r.
    With `into=` the layer list the pipeline was given (a list or an
    `nnx.Sequential`), each NNX module there is updated in place with its
    values (`nnx.update`), ready to evaluate or to save with orbax.
    """
    if isinstance(params, TrainState):
        params = params.params
    if not isinstance(params, Staged):
        raise ArgumentTypeError(f"unstage expects the Staged parameters of a pipeline (pipe.init, "
                                f"grads, state.params), not {type(params).__name__}")
    values = [layer for stage in params.per_stage(replica) for layer in stage]
    order = params.packing.order  # virtual stages: device by device, chunk by chunk
    if order is not None:
        values = [values[n] for n in sorted(range(len(values)), key=order.__getitem__)]
    if into is not None:
        write_into(values, into)
    return values
