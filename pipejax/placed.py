"""Where each parameter of a pipeline lives: its stage, its split, its bytes a device.

A pipeline packs each stage's parameters into slot buffers (packing.py), so
the arrays it holds say nothing about one parameter, and `pj.unstage` gives
whole single-device values. `pj.parameters(pipe)` reads each leaf's place
from the build instead: the stage that holds it, the `PartitionSpec` of its
split over `tensor` (Flax's annotation, as the compiled step applies it),
the FSDP degree its stage's slots are cut into (a flat piece a device, not
an axis of the leaf), and the bytes one device holds of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from pipejax.formatting import human_bytes, table
from pipejax.mesh import TENSOR


class Placed(NamedTuple):
    """One parameter leaf of a pipeline."""

    stage: int  # the stage (device row of the mesh's `stage` axis) that holds it
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: P  # its split over `tensor` (P() when whole)
    fsdp: int  # the pieces its stage's slots are cut into (1: whole on each device)
    device_bytes: int  # what one device of its stage holds of it


class Placements(list):
    """`pj.parameters(pipe)`: one entry per layer, printed as a table."""

    def __str__(self) -> str:
        return render(self)


def parameters(pipe: Any) -> Placements:
    """One entry per layer, the layer's parameter tree with a `Placed` at
    every leaf (a tied weight: where each copy lives, one per holding stage,
    in the layer that holds it); `print` it for a table."""
    code = pipe.build.code
    F, T = pipe.build.stage.fsdp, pipe.build.stage.tensor
    out: list = [None] * len(pipe.specs)
    for j in range(pipe.plan.chunks):
        k = pipe.plan.placement.device(j)
        leaves = iter(code.param_leaves(j))
        for spec, tree in zip(pipe.plan.stage_specs(j), code.abstract_params(j)):
            def place(a: Any) -> Placed:
                leaf = next(leaves)
                axis = leaf.tensor_axis
                spec = P(*[TENSOR if i == axis else None for i in range(len(leaf.shape))])
                pieces = (T if axis is not None else 1) * F
                size = -(-leaf.size // pieces) * np.dtype(a.dtype).itemsize
                return Placed(k, tuple(leaf.shape), np.dtype(a.dtype),
                              spec if axis is not None else P(), F, size)
            out[spec.index] = jax.tree.map(place, nn.meta.unbox(tree))  # linen's boxes off
    return Placements(out)


def render(placed: list) -> str:
    """A table of `parameters(pipe)`: a row per leaf."""
    rows = [["layer", "parameter", "stage", "shape", "split", "fsdp", "a device"]]
    for i, tree in enumerate(placed):
        for path, p in jax.tree_util.tree_flatten_with_path(
                tree, is_leaf=lambda x: isinstance(x, Placed))[0]:
            name = jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
            rows.append([str(i), name,
                         str(p.stage), f"{p.dtype}{list(p.shape)}", str(p.spec), str(p.fsdp),
                         human_bytes(p.device_bytes)])
    return table(rows)
