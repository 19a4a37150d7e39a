"""Stage-sharded containers: `StagedParams`, `TrainState`, and `unstage`.

Parameters live as packed slot buffers of shape `[K, length]`, sharded
over the mesh axis `stage` so that row k sits on stage k's device. The
packing travels as static pytree metadata, so `unstage` can always give back
one Flax variables dict per layer, independent of the number of stages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax.packing import Buffers, Packing


@jax.tree_util.register_pytree_node_class
class StagedParams:
    """Slot buffers `[K, length]` plus the static `Packing` that reads them."""

    def __init__(self, buffers: Buffers, packing: Packing):
        self.buffers = tuple(buffers)
        self.packing = packing

    def tree_flatten(self):
        return self.buffers, self.packing

    @classmethod
    def tree_unflatten(cls, packing, children):
        return cls(children, packing)

    def __repr__(self) -> str:
        n = sum(int(np.prod(np.shape(b))) for b in self.buffers)
        return (f"StagedParams(stages={self.packing.stages}, slots={len(self.buffers)}, "
                f"elements={n})")


class TrainState(NamedTuple):
    """Everything `pipe.step` carries from one step to the next."""

    params: StagedParams
    opt_state: Buffers  # slot buffers [K, length], packed like the parameters
    step: jax.Array  # int32 scalar: number of steps taken
    key: jax.Array  # base key; step t uses fold_in(key, t) for dropout
    inflight: Any = None  # asynchronous schedules: ring buffers and counters between steps


def unstage(params: StagedParams) -> list[dict]:
    """One Flax variables dict per layer ({} for a plain function), in layer order.

    The result does not depend on how many stages the pipeline had, so it is
    the form to checkpoint, evaluate or re-stage with `pipe.stage`.
    """
    if isinstance(params, TrainState):
        params = params.params
    if not isinstance(params, StagedParams):
        raise TypeError(f"unstage expects the StagedParams of a pipeline (pipe.init, grads, "
                        f"state.params), not {type(params).__name__}")
    layers: list[dict] = []
    host = [np.asarray(jax.device_get(b)) for b in params.buffers]
    for k in range(params.packing.stages):
        layers.extend(params.packing.unpack(k, tuple(b[k] for b in host)))
    return [jax.tree.map(jax.numpy.asarray, v) for v in layers]
