"""Token ids and class labels checked against their range before a step (`checks=True`).

Flax's `Embed` gathers with a fill value, so an id at or past the vocabulary
gives a NaN loss, and a negative one wraps around to the end of the table;
an out-of-range target does the same in the cross-entropy, without a word.
With `pj.pipeline(..., checks=True)` every integer leaf of a batch's inputs
and targets is checked before the step runs: one small jitted reduction (how
many ids fall outside their range), read on the host, which raises a
`BatchError` naming the leaf, the offending ids and the range before the
state is touched. That read is a device-to-host round trip at every step,
so the check is opt-in. (`checkify`, or a flag in the metrics, would fold
it into the step, but its error would come after the step had consumed the
donated state: the state would be lost with the batch.)

An input's range is the first layer's embedding table: a parameter named
`embedding` of shape [vocabulary, width] (linen's and NNX's `Embed`); a
target's is the model output's last axis (its classes or vocabulary). Ids
are never negative; an integer leaf with no known bound is checked for that.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from pipejax.data import outside
from pipejax.errors import BatchError
from pipejax.layers.ties import names

Bound = int | None | bool  # the ids' upper bound; None: none known; False: not ids (floats, bools)


class Ranges(NamedTuple):
    """The upper bound of every leaf of a batch's inputs and of its targets."""

    inputs: tuple[Bound, ...]
    targets: tuple[Bound, ...]


def ranges(specs: Sequence[Any], example: Any, targets: Any) -> Ranges:
    """The ranges of a pipeline's batches: inputs bounded by the first
    layer's embedding table, targets by the output's last axis."""
    tables = [leaf.shape[0] for path, leaf in jax.tree_util.tree_flatten_with_path(
        specs[0].variables)[0] if names(path)[-1:] == ("embedding",) and len(leaf.shape) == 2]
    outputs = [o.shape[-1] for o in jax.tree.leaves(specs[-1].output)
               if jnp.issubdtype(o.dtype, jnp.floating) and o.ndim]
    bound = lambda tree, high: tuple(high if jnp.issubdtype(leaf.dtype, jnp.integer) else False
                                     for leaf in jax.tree.leaves(tree))
    return Ranges(bound(example, tables[0] if tables else None),
                  bound(targets, outputs[0] if outputs else None))


def check(batch: Any, ranges: Ranges, where: str) -> None:
    """Raise a `BatchError` if an id of `batch` (inputs, targets) is out of
    range; an abstract batch (`trainer.step.lower` on shapes) has no ids to check."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2) or any(
            isinstance(a, (jax.ShapeDtypeStruct, jax.core.Tracer)) for a in jax.tree.leaves(batch)):
        return  # not a batch (the step's own check says so), or not values
    for name, tree, highs in (("inputs", batch[0], ranges.inputs),
                              ("targets", batch[1], ranges.targets)):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        if len(leaves) != len(highs):
            return
        counts = _outside(tuple(leaf for _, leaf in leaves), highs)
        for (path, leaf), high, count in zip(leaves, highs, counts):
            if high is not False and int(count):
                _, values = outside(leaf, 0, high)
                shown = ", ".join(map(str, values))
                span = f"[0, {high})" if high is not None else "0 and above"
                raise BatchError(
                    f"{where}: {name}{jax.tree_util.keystr(path)} holds {int(count)} ids "
                    f"outside {span}: {shown}; an id past the table gives a NaN loss and a "
                    "negative one wraps around: map them into range (an unknown-token id) "
                    "or drop those examples")


@functools.partial(jax.jit, static_argnums=1)
def _outside(leaves: tuple, highs: tuple) -> list:
    """How many ids of each leaf fall outside [0, its bound) (0 for a leaf not checked)."""
    return [jnp.zeros((), jnp.int32) if high is False else
            jnp.sum((leaf < 0) | (leaf >= high if high is not None else False))
            for leaf, high in zip(leaves, highs)]
