"""What a trainer carries from one step to the next, typed.

`Staged` is a pytree packed into stage-sharded slot buffers `[K, length]`
(row k on stage k's device) together with the static `Packing` that reads
them back; parameters, gradients and per-stage optimizer states are all
`Staged`. `TrainState` is the whole state of a trainer; for an asynchronous
schedule its `inflight` part (`InFlight`: ring buffers, data rings and the
micro-batch counters) is allocated by `trainer.init`, so every step runs the
same compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax.compile.packing import Buffers, Packing
from pipejax.errors import ArgumentTypeError


@jax.tree_util.register_pytree_node_class
class Staged:
    """Slot buffers `[K, length]` plus the static `Packing` that reads them."""

    def __init__(self, buffers: Buffers, packing: Packing):
        self.buffers = tuple(buffers)
        self.packing = packing

    def tree_flatten(self):
        return self.buffers, self.packing

    @classmethod
    def tree_unflatten(cls, packing, children):
        return cls(children, packing)

    def per_stage(self) -> list[Any]:
        """The K stage trees as ordinary pytrees of arrays (copied to the host and back)."""
        host = [np.asarray(jax.device_get(b)) for b in self.buffers]
        return [jax.tree.map(jax.numpy.asarray, self.packing.unpack(k, tuple(b[k] for b in host)))
                for k in range(self.packing.stages)]

    def __repr__(self) -> str:
        n = sum(int(np.prod(np.shape(b))) for b in self.buffers)
        return f"Staged(stages={self.packing.stages}, slots={len(self.buffers)}, elements={n})"


class Rings(NamedTuple):
    """Ring buffers of one pipeline, slots `micro-batch mod capacity`.

    The field order is the order of the scan's carry, and XLA's buffer
    assignment depends on it: with the inputs first, the GPipe step of a
    16 × 512 MLP (K = 4, M = 8) needed one more 64 KiB micro-batch buffer of
    temp memory (5,482,456 bytes against 5,411,544, measured).
    """

    grads: Buffers  # output gradients received, kept up to the backward
    kept: Buffers  # vjp residuals kept from the forward to the backward
    inputs: Buffers  # stage inputs received, kept up to their backward
    weights: Buffers  # with weight stashing: the weights each forward used; else ()


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


def unstage(params: Staged | TrainState) -> list[dict]:
    """One Flax variables dict per layer ({} for a plain function), in layer order.

    The result does not depend on how many stages the pipeline had, so it is
    the form to checkpoint, evaluate or re-stage with `pipe.stage`.
    """
    if isinstance(params, TrainState):
        params = params.params
    if not isinstance(params, Staged):
        raise ArgumentTypeError(f"unstage expects the Staged parameters of a pipeline (pipe.init, "
                                f"grads, state.params), not {type(params).__name__}")
    return [layer for stage in params.per_stage() for layer in stage]
