"""Tied weights across stages: every stage that uses a shared matrix holds a copy.

Megatron-LM keeps the tied input embedding and output head as a copy on the
first and on the last stage and all-reduces their gradients over its
"embedding group" before the optimizer. So here: each layer that holds a
shared module (layers/ties.py) has its copy in its stage's packed
parameters, wherever its slot lands there; `tied` records each tie's
leaves as (device, leaf index) groups in the parameter `Packing`, the one
home every program reads them from. The copies start equal (`initial`: the
first holder's values), and at every step `summed` gives each copy the sum
of every copy's gradient, a psum over the stage axis: the gradient of the
one matrix the sequential model has (the sum of both uses). The same update
of the same gradient by the same optimizer keeps them equal, and `equal`
sets every copy to the first after each update, bitwise.
`counted_once` is the gradient with one copy of each tie, for the global
norm (`clip_norm`). `Staged.per_stage` hands the copies back as one array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.compile.spmd import gather
from pipejax.layers.ties import Tie, names
from pipejax.mesh import STAGE, FSDP
from pipejax.packing import Buffers, Packing
from pipejax.partition import Plan


def tied(packing: Packing, plan: Plan, ties: Sequence[Tie]) -> Packing:
    """The parameter `packing` of `plan` with each tie's leaves recorded as
    (device, leaf index in the device's packed tree) groups."""
    if not ties:
        return packing
    where = {}
    for k in range(packing.stages):
        layers = plan.device_layers(k)
        flat = jax.tree_util.tree_flatten_with_path(packing.abstract_tree(k))[0]
        for n, (path, _) in enumerate(flat):
            where[(layers[path[0].idx], names(path[1:]))] = (k, n)
    return dataclasses.replace(packing, tied=tuple(tuple(where[h] for h in tie.holders)
                                                   for tie in ties))


def initial(variables: Callable[[int], Any], ties: Sequence[Tie]) -> Callable[[int], Any]:
    """`variables` (layer i -> its variables) with each tied leaf taken from
    its tie's first holder: the shared matrix is initialized once."""
    if not ties:
        return variables
    first = {h: tie.holders[0] for tie in ties for h in tie.holders[1:]}

    def tied_variables(i: int) -> Any:
        seen: dict[int, dict] = {}  # a first holder's leaves by path, made once

        def leaf(path: tuple, x: Any) -> Any:
            source = first.get((i, names(path)))
            if source is None:
                return x
            if source[0] not in seen:
                seen[source[0]] = {names(p): v for p, v in jax.tree_util.tree_flatten_with_path(
                    variables(source[0]))[0]}
            return seen[source[0]][source[1]]
        return jax.tree_util.tree_map_with_path(leaf, variables(i))

    return tied_variables


def summed(packing: Packing, grads: Buffers, fsdp: int = 1) -> Buffers:
    """Inside shard_map: a device's packed gradient (its piece of each slot
    where the stage is sharded over `fsdp` devices) with each tied
    leaf replaced by the sum over every copy on every stage."""
    return _spread(packing, grads, fsdp, lambda group: group, lambda group: group)


def equal(packing: Packing, params: Buffers, fsdp: int = 1) -> Buffers:
    """Inside shard_map: a device's packed parameters with each tied leaf set
    to its tie's first copy, after an update. The copies get one gradient
    and one optimizer, but each stage's update is its own branch, which XLA
    compiles on its own: split over `tensor`, the copies of the tied GPT's
    embedding differed in the last bit after 20 AdamW steps
    (tests/models/test_tied.py); whole, they had not."""
    return _spread(packing, params, fsdp, lambda group: group[:1], lambda group: group[1:])


def _spread(packing: Packing, buffers: Buffers, fsdp: int, sources: Callable,
            targets: Callable) -> Buffers:
    """Each tie's leaf on its `targets(group)` copies set to the sum of its
    `sources(group)` copies, a psum over the stage axis.

    A slot holds one leaf of each stage at its first rows, so copies in
    one slot on distinct stages line up row by row, and so do their fsdp
    pieces: the psum runs on the slot as it is (the embedding and the head
    of one vocabulary rank alike and share a slot). Otherwise the leaf is
    read from its slot gathered whole over `fsdp` and put back as this
    device's piece."""
    if not packing.tied:
        return buffers
    k, out = lax.axis_index(STAGE), list(buffers)
    for group in packing.tied:
        devices = lambda holders: jnp.isin(k, jnp.array([d for d, _ in holders]))
        slots = {packing.leaves[d][n].slot for d, n in group}
        if len(slots) == 1 and len({d for d, _ in group}) == len(group):
            j = slots.pop()
            total = lax.psum(jnp.where(devices(sources(group)), out[j], 0), STAGE)
            out[j] = jnp.where(devices(targets(group)), total, out[j])
            continue
        whole = _gathered(packing, out, slots, fsdp)
        leaves = lambda holders: [(d, packing.leaves[d][n]) for d, n in holders]
        total = lax.psum(sum(jnp.where(k == d, packing.from_slot(s, whole[s.slot]), 0.0)
                             for d, s in leaves(sources(group))), STAGE)
        for d, s in leaves(targets(group)):
            _put(packing, whole, k == d, s, total)
        _scattered(out, whole, slots, fsdp)
    return tuple(out)


def _gathered(packing: Packing, out: list, slots: set, fsdp: int) -> list:
    """`out` with `slots` whole: gathered over `fsdp` where sharded (XLA
    drops the gathers of the other slots, whose results nothing reads)."""
    if fsdp == 1:
        return list(out)
    whole = gather(tuple(out), packing)
    return [whole[j] if j in slots else b for j, b in enumerate(out)]


def _scattered(out: list, whole: list, slots: set, fsdp: int) -> None:
    """Set `slots` of `out` to this device's fsdp piece of `whole`."""
    for j in slots:
        rows = out[j].shape[0]
        out[j] = (whole[j] if fsdp == 1 else
                  lax.dynamic_slice_in_dim(whole[j], lax.axis_index(FSDP) * rows, rows))


def counted_once(packing: Packing, grads: Buffers) -> Buffers:
    """Inside shard_map: `grads` with every copy of a tied leaf but the
    first zeroed: what the global norm sums, one matrix counted once. The
    copy's slot holds only it on its stage (and zero padding), so the
    whole slot, or its fsdp piece, is zeroed."""
    if not packing.tied:
        return grads
    k, out = lax.axis_index(STAGE), list(grads)
    for group in packing.tied:
        for d, n in group[1:]:
            j = packing.leaves[d][n].slot
            out[j] = jnp.where(k == d, jnp.zeros_like(out[j]), out[j])
    return tuple(out)


def _put(packing: Packing, out: list, here: jax.Array, s: Any, x: jax.Array) -> None:
    """Set leaf `s` of the slot buffers `out` to `x` on the device where
    `here` is true; elsewhere the slot stays as it is."""
    b = out[s.slot]
    v = packing.to_slot(s, x).astype(b.dtype)
    out[s.slot] = jnp.where(here, v if v.shape == b.shape else b.at[:v.shape[0]].set(v), b)
