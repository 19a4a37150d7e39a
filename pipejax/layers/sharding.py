"""Which axis of each parameter a layer splits over the mesh axis `tensor`.

Flax's own partitioning metadata is the interface (no pipejax annotation):
linen's `nn.with_partitioning(init, names)` and
`nn.with_logical_partitioning(init, logical_names)` (logical names mapped
to mesh axes by the box's rules or the `nn.logical_axis_rules` in force
when the pipeline is built; a logical name without a rule is replicated,
as in Flax), and NNX's variable metadata (`nnx.with_partitioning`, the
key `out_sharding`, logical names mapped as `nnx.get_partition_spec`
maps them: by the variable's `sharding_rules` and the rules in force).

An annotation may name "tensor" (that axis is split over the stage's T
tensor devices) and "fsdp" (pipejax's FSDP splits every parameter anyway,
annotated or not); `None` replicates. Any other name is an error that
names the layer and the variable, never dropped: pipejax cannot guess
what "model" or "mp" should mean on its mesh.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from flax.nnx import spmd as nnx_spmd

from pipejax.errors import LayerError
from pipejax.mesh import FSDP, TENSOR

_MEANINGFUL = (TENSOR, FSDP)  # the names an annotation may give


def _boxed(x: Any) -> bool:
    return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def _names(box: Any) -> tuple | None:
    """The mesh-axis names of one annotated leaf (None: no annotation)."""
    if isinstance(box, nn.LogicallyPartitioned):
        return tuple(nn.logical_to_mesh_axes(box.names, box.rules))
    if isinstance(box, meta.Partitioned):
        return tuple(box.names)
    if isinstance(box, nnx.Variable):  # its out_sharding, logical names mapped by the rules
        spec = nnx_spmd.get_var_pspec(box)
        return None if spec is None else tuple(spec)
    return None


def tensor_axes(variables: Any, layer: str, parts: int) -> list[int | None]:
    """For each leaf of `variables` (in `jax.tree.leaves` order), the axis
    its annotation splits over "tensor" (None: none), for `parts` = T
    devices. `layer` names the layer in errors.

    Raises:
      LayerError: an annotation naming an axis pipejax does not know,
        naming "tensor" twice, or an axis that T does not divide.
    """
    out: list[int | None] = []
    flat = jax.tree_util.tree_flatten_with_path(variables, is_leaf=_boxed)[0]
    for path, leaf in flat:
        names = _names(leaf) if _boxed(leaf) else None
        arrays = jax.tree.leaves(leaf)
        if names is None or not arrays:
            out += [None] * len(arrays)
            continue
        where = f"{layer}'s variable {jax.tree_util.keystr(path, simple=True, separator='/')}"
        out += [_axis(names, a.shape, where, parts, isinstance(leaf, nnx.Variable))
                for a in arrays]
    return out


def _axis(names: Sequence, shape: tuple, where: str, parts: int, nnx_api: bool) -> int | None:
    """The axis of `shape` that annotation `names` splits over "tensor"
    (names for the leading axes only, as in a `PartitionSpec`: the rest whole)."""
    entries = [() if n is None else (n,) if isinstance(n, str) else tuple(n) for n in names]
    unknown = sorted({a for e in entries for a in e if a not in _MEANINGFUL})
    if unknown:
        raise LayerError(
            f"{where} is annotated {tuple(names)}, naming {', '.join(map(repr, unknown))}: "
            f"a pipeline's parameters may be split over {TENSOR!r} (tensor parallelism) and "
            f"{FSDP!r}; rename the axis (e.g. {'nnx' if nnx_api else 'nn'}.with_partitioning("
            f"init, (None, {TENSOR!r}))), or map a logical name to {TENSOR!r} with "
            f"{'nnx.logical_axis_rules' if nnx_api else 'nn.logical_axis_rules'}")
    if len(entries) > len(shape):
        raise LayerError(f"{where} of shape {shape} is annotated {tuple(names)}: "
                         f"{len(entries)} names for {len(shape)} axes; name at most one per axis")
    split = [i for i, e in enumerate(entries) if TENSOR in e]
    if not split:
        return None
    if len(split) > 1:
        raise LayerError(f"{where} of shape {shape} is annotated {tuple(names)}: name "
                         f"{TENSOR!r} on one of its {len(shape)} axes, once")
    d = split[0]
    if shape[d] % parts:
        raise LayerError(
            f"{where} of shape {shape} splits axis {d} ({shape[d]}) over tensor={parts} "
            f"devices, which do not divide it; use a tensor degree that divides {shape[d]}, "
            f"or a size of that axis that tensor={parts} divides")
    return d
