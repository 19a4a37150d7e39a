"""Tensor parallelism inside a stage: parameters split over the mesh axis
`tensor`, partitioned by XLA (Shoeybi et al. 2019, Megatron-LM §3).

The pipeline's programs are `shard_map`s manual over every axis but
`tensor` (spmd.shard): they place stages, replicas and FSDP pieces by hand
and leave `tensor` to XLA's SPMD partitioner, which reads the splits that
the layers' Flax annotations give (layers/sharding.py) from the slots
(packing.py: a split leaf's slot is (m, T), its last axis over `tensor`)
and from the constraint on every unpacked leaf (`mesh.constrain`), and
inserts the collectives of Megatron's layout itself (an all-reduce after a
row-parallel matrix product). Nothing in a layer changes. The residuals a
stage keeps for its backward are split where XLA computes them split
(`kept_packing`), so that a device keeps its heads' attention and its part
of the MLP's hidden units, as in Megatron's layout.

The element-wise collectives of the data rules (SSGD's mean,
ADPSGD's exchange) need no such care: XLA keeps the split (no all-gather
in the GPT's step at data 2 x tensor 2, measured).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.compile.rendezvous import permutes
from pipejax.compile.stages import StageCode
from pipejax.mesh import TENSOR, tensor_degree
from pipejax.packing import Packing


def slot_shardings(mesh: Mesh, spec: P, packing: Packing, ndim: int) -> tuple:
    """Where each slot buffer `[lead..., slot shape]` of partition `spec` (the
    manual axes') lives: a split slot's last axis over `tensor` too. `ndim`
    is the number of leading axes."""
    out = []
    for (_, shape), split in zip(packing.slots, packing.tensor_slots):
        if split:
            full = [*spec, *[None] * (ndim + len(shape) - len(spec))]
            full[-1] = TENSOR
            out.append(NamedSharding(mesh, P(*full)))
        else:
            out.append(NamedSharding(mesh, spec))
    return tuple(out)


def tensor_share(code: StageCode, j: int) -> tuple[float, int]:
    """Of virtual stage j's parameters: the share (of elements) split over
    `tensor`, and how many split matrices take a split input (their axis 0
    split: Megatron's row-parallel matrices, an embedding over its
    vocabulary), each an all-reduce of its output in the forward (and one
    of an input gradient in the backward)."""
    leaves = code.param_leaves(j)
    total = sum(s.size for s in leaves)
    split = sum(s.size for s in leaves if s.tensor_axis is not None)
    rows = sum(1 for s in leaves if s.tensor_axis == 0 and len(s.shape) >= 2)
    return (split / total if total else 0.0), rows


def crossing_lines(code: StageCode, j: int, mesh: Mesh) -> tuple[str, ...]:
    """The user's lines of virtual stage j's collective-permutes as XLA
    partitions its vjp (every intermediate kept, so that nothing is left
    out) compiled alone on one group of the mesh's T tensor devices, each
    parameter split as annotated; once per process for equal layers, shapes
    and T. In the pipeline these are collectives that join the devices of
    every stage inside stage j's branch (rendezvous.py)."""
    def compiled() -> tuple[str, ...]:
        devices, shardings = _group(code, j, mesh)
        h = code.input_of(j)
        everything = jax.checkpoint_policies.everything_saveable
        kept = jax.jit(lambda p, h, f: code.vjp(j, p, h, f, everything)[1],
                       in_shardings=(shardings, None if h is None else
                                     NamedSharding(devices, P()), None))
        return permutes(kept.lower(code.abstract_params(j), h, code.abstract_feed())
                        .compile().as_text())

    return code.remembered(j, ("crossing over tensor", tensor_degree(mesh)), compiled)


def _group(code: StageCode, j: int, mesh: Mesh) -> tuple[Mesh, Any]:
    """One group of the mesh's T tensor devices, and virtual stage j's
    parameters placed on it as annotated."""
    T = tensor_degree(mesh)
    group = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(TENSOR), -1)
    devices = Mesh(group.reshape(-1, T)[0], (TENSOR,))
    return devices, jax.tree.unflatten(jax.tree.structure(code.abstract_params(j)),
                                       [_placed(devices, s) for s in code.param_leaves(j)])


def _placed(devices: Mesh, leaf: Any) -> NamedSharding:
    """Where a packed leaf lives on one group of tensor devices: split on its
    `split` axis, else whole."""
    return NamedSharding(devices, P(*[TENSOR if i == leaf.tensor_axis else None
                                      for i in range(len(leaf.shape))]))


def kept_packing(code: StageCode, mesh: Mesh) -> Packing:
    """The kept ring's packing with each residual split over `tensor` on the
    axis XLA's partitioner splits it (an attention's heads, an MLP's hidden
    units), read from each stage's forward compiled alone on one group of T
    tensor devices (`_group`); whole where XLA keeps it whole or splits it
    unevenly. Packed whole, the ring held T copies of what XLA computes
    split, and XLA kept a split shadow of the ring besides: the zoo GPT 6x64
    at K = 2, tensor 2, remat "none" took 30.5 MiB a device under GPipe and
    9.9 MiB under 1F1B; split, 17.3 and 8.1 MiB."""
    T, remat = tensor_degree(mesh), code.model.remat
    if T == 1 or not any(code.kept.leaves[j] for j in range(code.kept.stages)):
        return code.kept

    def axes(j: int) -> list[int | None]:
        devices, shardings = _group(code, j, mesh)
        h = code.input_of(j)
        forward = jax.jit(lambda p, h, f: code.vjp(j, p, h, f, remat)[1],
                          in_shardings=(shardings, None if h is None else
                                        NamedSharding(devices, P()), None))
        compiled = forward.lower(code.abstract_params(j), h, code.abstract_feed()).compile()
        kept = jax.tree.leaves(code.residuals(j, remat))
        return [_split_axis(s, x.shape, T) for s, x in
                zip(jax.tree.leaves(compiled.output_shardings), kept)]

    kept_axes = [code.remembered(j, ("kept axes over tensor", remat, T), lambda: axes(j))
                 for j in code.groups.first]
    trees = [code.residuals(j, remat) for j in code.groups.first]
    return Packing.of([trees[g] for g in code.groups.of],
                      tensor_axes=[kept_axes[g] for g in code.groups.of], tensor=T)


def _split_axis(sharding: Any, shape: tuple[int, ...], T: int) -> int | None:
    """The one axis `sharding` splits evenly over `tensor`, or None."""
    over = [i for i, e in enumerate(getattr(sharding, "spec", ()))
            if TENSOR in (e if isinstance(e, tuple) else (e,))]
    return over[0] if len(over) == 1 and shape[over[0]] % T == 0 else None


def backward_bytes(code: StageCode, j: int, mesh: Mesh, options: dict) -> int:
    """One tensor device's temporary and output bytes of virtual stage j's
    backward compiled alone on one group of T tensor devices (compiled with
    `options`), once per process for equal stages: what the replayed
    forward keeps (with remat) or what the backward makes again from the
    kept residuals (without), and the gradients, as XLA partitions them."""
    def compiled() -> int:
        devices, shardings = _group(code, j, mesh)
        whole = NamedSharding(devices, P())
        params, h, feed, kept, ct = code.backward_args(j)
        ins = (shardings, None if h is None else whole, None,
               [_placed(devices, s) for s in code.kept.leaves[j]], None if ct is None else whole)
        program = jax.jit(functools.partial(code.backward, j), in_shardings=ins)
        analysis = program.lower(params, h, feed, kept, ct).compile(options).memory_analysis()
        return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)

    return code.remembered(j, ("split backward bytes", code.model.remat, tensor_degree(mesh)),
                           compiled)
