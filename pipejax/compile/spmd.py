"""SPMD helpers: one program on every device of the stage mesh.

Inside `shard_map` each device holds its row of every stage-sharded buffer:
a pipeline's `[K, ...]` arrays sharded over the mesh axis `stage` (one model,
the same on every replica), or a trainer's `[R·K, ...]` arrays sharded over
the data axes and `stage` (row r·K + k on replica r's stage k). A stage
sharded over F devices of axis `fsdp` splits each parameter row along its
length (`params`: device f holds the f-th piece), and keeps what differs
per device (optimizer state, rings) in rows of their own, `[R·K·F, ...]`
(`per_device`). These helpers drop and restore that leading axis, build
the `shard_map`s and placements every program uses, run a piece of work
on a condition without copying the buffers it passes through, and join a
stage's FSDP pieces (compile/fsdp.py) into whole slots and back (`gather`,
`scatter`).

FSDP's gathers and scatters over the manual axis `fsdp` on a slot split
over `tensor` run in a `shard_map` manual over `tensor` too (`per_column`):
on each tensor device's own column. Left to the partitioner, such a
gather first gathers the slot whole over `tensor` (measured: a stage's
weights all-gathered over `tensor` before each FSDP gather, on 8 CPU
devices).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.mesh import FSDP, STAGE, TENSOR, batch_axes, data_axes, fsdp_degree, manual_axes
from pipejax.packing import Buffers, Packing

REPLICATED = P()


def _fsdp(mesh: Mesh) -> tuple[str, ...]:
    return (FSDP,) if fsdp_degree(mesh) > 1 else ()


def params(mesh: Mesh, replicas: bool = True) -> P:
    """Packed parameters (or gradients) `[R·K, length]`: row r·K + k on
    replica r's stage k, split along its length over `fsdp` (`[K, length]`
    when not `replicas`: one model)."""
    rows = (*data_axes(mesh), STAGE) if replicas else STAGE
    return P(rows, *_fsdp(mesh))


def per_device(mesh: Mesh) -> P:
    """A `[R·K·F, ...]` buffer, a row per device: (r·K + k)·F + f on device
    f of replica r's stage k (`[R·K, ...]` when F = 1)."""
    return P((*data_axes(mesh), STAGE, *_fsdp(mesh)))


def split_batch(mesh: Mesh) -> P:
    """A batch `[R, M, mb, ...]`: part r on every stage of replica r, each
    micro-batch split over `fsdp` (replicated when R = F = 1)."""
    return P(data_axes(mesh) or None, *((None, FSDP) if _fsdp(mesh) else ()))


def replica_key(key: jax.Array, mesh: Mesh) -> jax.Array:
    """Inside shard_map: the key of this device's part of the batch,
    fold_in(key, i) with i its index over the batch axes (the replica r,
    with `fsdp` r·F + f) when there are several, else `key` itself."""
    axes = batch_axes(mesh)
    if not axes or all(mesh.shape[a] == 1 for a in axes):
        return key
    return jax.random.fold_in(key, lax.axis_index(axes))


def local(tree: Any) -> Any:
    """Inside shard_map: drop the leading stage axis (length 1 on each device)."""
    return jax.tree.map(lambda b: b[0], tree)


def lead(tree: Any) -> Any:
    """Inside shard_map: add the leading stage axis back for stage-sharded outputs."""
    return jax.tree.map(lambda b: b[None], tree)


def in_place(fn: Callable) -> Callable:
    """Inside shard_map: `fn` of this device's rows, applied to the
    stage-sharded blocks themselves (leading axis of length 1, vmapped): its
    outputs come out in the blocks' shape. With `local` and `lead` around an
    update instead, the reshape back to the block makes XLA fuse the update
    twice (the new state computed once for itself and again for the new
    weights: 6 % more bytes than plain jit on the MLP)."""
    return jax.vmap(fn)


def stage_index() -> jax.Array:
    """Inside shard_map: k, the index of this device's stage."""
    return lax.axis_index(STAGE)


def shard(fn: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`fn` as one SPMD program over `mesh` (varying-axis checks off: the
    branches of a stage switch differ per device by design), manual over
    every axis but `tensor`, which XLA partitions (compile/tensor.py)."""
    manual = manual_axes(mesh)
    extra = {} if manual is None else {"axis_names": set(manual)}
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False,
                         **extra)


def sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """Where a buffer of partition `spec` lives on `mesh`."""
    return NamedSharding(mesh, spec)


def run_if(pred: jax.Array, fn: Callable, operands: Any, carry: Any) -> Any:
    """`fn(operands, carry)` if `pred`, else `carry`: a while loop of 0 or 1 trips.

    Not a `lax.cond`: XLA updates a loop carry (the gradient sum, the residual
    ring buffer) in place, but copies every buffer a conditional passes through
    untouched — two copies of all gradients per tick, measured. The barrier
    ties the operands to the trip counter, so that XLA cannot hoist the work
    out of the loop as loop-invariant and run it at every tick.
    """
    def body(c):
        trips, carry = c
        trips, ops = lax.optimization_barrier((trips, operands))
        return trips + 1, fn(ops, carry)

    return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body,
                          (jnp.int32(0), carry))[1]


def per_column(fn: Callable, buffers: Buffers, packing: Packing) -> Buffers:
    """Inside the pipeline's shard_map: `fn` of each slot buffer (its slot's
    trailing axes last), on every tensor device's own column of a split slot."""
    out = []
    for b, split in zip(buffers, packing.tensor_slots):
        if not split:
            out.append(fn(b))
            continue
        spec = P(*[None] * (b.ndim - 1), TENSOR)
        out.append(jax.shard_map(fn, in_specs=spec, out_specs=spec, axis_names={TENSOR},
                                 check_vma=False)(b))
    return tuple(out)


def gather(pieces: Buffers, packing: Packing) -> Buffers:
    """Inside shard_map: every slot of `packing` whole from this stage's F
    pieces (a slot split over `tensor`: each tensor device's column)."""
    return per_column(lambda b: lax.all_gather(b, FSDP, axis=0, tiled=True), pieces, packing)


def scatter(grads: Buffers, fsdp: int, packing: Packing) -> Buffers:
    """Inside shard_map: this device's piece of the mean over the stage's F
    devices of the whole gradients `grads` (slots of `packing`)."""
    return per_column(lambda g: lax.psum_scatter(g, FSDP, scatter_dimension=0, tiled=True)
                      / fsdp, grads, packing)
