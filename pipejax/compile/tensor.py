"""Tensor parallelism inside a stage: parameters split over the mesh axis
`tensor`, partitioned by XLA (Shoeybi et al. 2019, Megatron-LM §3).

The pipeline's programs are `shard_map`s manual over every axis but
`tensor` (spmd.shard): they place stages, replicas and FSDP pieces by hand
and leave `tensor` to XLA's SPMD partitioner, which reads the splits that
the layers' Flax annotations give (layers/sharding.py) from the slots
(packing.py: a split leaf's slot is (m, T), its last axis over `tensor`)
and from the constraint on every unpacked leaf (`mesh.constrain`), and
inserts the collectives of Megatron's layout itself (an all-reduce after a
row-parallel matrix product). Nothing in a layer changes.

The element-wise collectives of the data rules (SSGD's mean,
ADPSGD's exchange) need no such care: XLA keeps the split (no all-gather
in the GPT's step at data 2 x tensor 2, measured).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.compile.rendezvous import permutes
from pipejax.compile.stages import StageCode
from pipejax.mesh import TENSOR, tensor_parts
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


def split_parts(code: StageCode, j: int) -> tuple[float, int]:
    """Of virtual stage j's parameters: the share (of elements) split over
    `tensor`, and how many split matrices take a split input (their axis 0
    split: Megatron's row-parallel matrices, an embedding over its
    vocabulary), each an all-reduce of its output in the forward (and one
    of an input gradient in the backward)."""
    leaves = code.param_leaves(j)
    total = sum(s.size for s in leaves)
    split = sum(s.size for s in leaves if s.split is not None)
    rows = sum(1 for s in leaves if s.split == 0 and len(s.shape) >= 2)
    return (split / total if total else 0.0), rows


class Alone(NamedTuple):
    """Virtual stage j's vjp compiled alone on one group of T tensor devices."""

    working: int  # one device's bytes of what the vjp keeps without remat (its working set)
    crossing: tuple[str, ...]  # the user's lines of its collectives that would cross stages


def alone(code: StageCode, j: int, mesh: Mesh) -> Alone:
    """Virtual stage j's vjp as XLA partitions it: the function compiled
    alone on one group of the mesh's T tensor devices, each parameter split
    as annotated; once per process for equal layers, shapes and T.

    Its output bytes are the working set: counting it whole over-predicted
    the zoo GPT's step by 1.45x at T = 2 and 2.03x at T = 4 (its MLP's hidden
    activations and attention's heads are split, the residual stream not).
    Its collective-permutes are the collectives that, in the pipeline, join
    the devices of every stage inside stage j's branch (rendezvous.py)."""
    T = tensor_parts(mesh)
    return code.remembered(j, ("alone over tensor", T), lambda: _compiled_alone(code, j, mesh))


def _group(code: StageCode, j: int, mesh: Mesh) -> tuple[Mesh, Any]:
    """One group of the mesh's T tensor devices, and virtual stage j's
    parameters placed on it as annotated."""
    T = tensor_parts(mesh)
    group = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(TENSOR), -1)
    devices = Mesh(group.reshape(-1, T)[0], (TENSOR,))
    place = lambda s: NamedSharding(devices, P(*[TENSOR if i == s.split else None
                                                 for i in range(len(s.shape))]))
    return devices, jax.tree.unflatten(jax.tree.structure(code.abstract_params(j)),
                                       [place(s) for s in code.param_leaves(j)])


def _compiled_alone(code: StageCode, j: int, mesh: Mesh) -> Alone:
    devices, shardings = _group(code, j, mesh)
    whole = NamedSharding(devices, P())
    h = code.input_of(j)
    everything = jax.checkpoint_policies.everything_saveable
    kept = jax.jit(lambda p, h, f: code.vjp(j, p, h, f, everything)[1],
                   in_shardings=(shardings, None if h is None else whole, None))
    compiled = kept.lower(code.abstract_params(j), h, code.abstract_feed()).compile()
    return Alone(int(compiled.memory_analysis().output_size_in_bytes),
                 permutes(compiled.as_text()))


def backward_bytes(code: StageCode, j: int, mesh: Mesh, options: dict) -> int:
    """One tensor device's temporary and output bytes of virtual stage j's
    backward compiled alone on one group of T tensor devices (compiled with
    `options`), once per process for equal stages: with remat, what the
    replayed forward keeps and the gradients, as XLA partitions them."""
    def compiled() -> int:
        devices, shardings = _group(code, j, mesh)
        whole = NamedSharding(devices, P())
        params, h, feed, kept, ct = code.backward_args(j)
        ins = (shardings, None if h is None else whole, None, [whole] * len(kept),
               None if ct is None else whole)
        program = jax.jit(functools.partial(code.backward, j), in_shardings=ins)
        analysis = program.lower(params, h, feed, kept, ct).compile(options).memory_analysis()
        return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)

    return code.remembered(j, ("split backward bytes", code.model.remat, tensor_parts(mesh)),
                           compiled)


def working_bytes(code: StageCode, j: int, mesh: Mesh) -> int:
    """One tensor device's bytes of what virtual stage j's vjp keeps without
    rematerialization (its working set), as XLA partitions it (`alone`)."""
    return alone(code, j, mesh).working
