"""Stage-sharded containers: `StagedParams`, `TrainState`, and `unstage`.

Parameters live as packed per-dtype buffers of shape `[K, length]`, sharded
over the mesh axis `stage` so that row k sits on stage k's device. The
packing travels as static pytree metadata, so `unstage` can always give back
one Flax variables dict per layer, independent of the number of stages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax.compile.packing import Buffers, Packing


@jax.tree_util.register_pytree_node_class
class StagedParams:
    """Per-dtype buffers `[K, length]` plus the static `Packing` that reads them."""

    def __init__(self, buffers: Buffers, packing: Packing):
        self.buffers = dict(buffers)
        self.packing = packing

    def tree_flatten(self):
        keys = tuple(sorted(self.buffers))
        return tuple(self.buffers[k] for k in keys), (keys, self.packing)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, packing = aux
        return cls(dict(zip(keys, children)), packing)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{d}{list(np.shape(b))}" for d, b in sorted(self.buffers.items()))
        return f"StagedParams(stages={self.packing.stages}, buffers={{{shapes}}})"


class TrainState(NamedTuple):
    """Everything `pipe.step` carries from one step to the next."""

    params: StagedParams
    opt_state: Buffers  # per-dtype [K, length], packed like the parameters
    step: jax.Array  # int32 scalar: number of steps taken
    key: jax.Array  # base key; step t uses fold_in(key, t) for dropout


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
    host = {d: np.asarray(jax.device_get(b)) for d, b in params.buffers.items()}
    for k in range(params.packing.stages):
        layers.extend(params.packing.unpack(k, {d: b[k] for d, b in host.items()}))
    return [jax.tree.map(jax.numpy.asarray, v) for v in layers]
