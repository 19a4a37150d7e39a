"""Pack each stage's pytree into flat buffers, one per dtype, padded to the largest stage.

Stages of a heterogeneous model have different parameter (and optimizer
state, activation, residual) trees, yet SPMD needs one array shape on every
device. A `Packing` records, for every stage, where each leaf lives in the
flat buffer of its dtype; `pack(k, tree)` and `unpack(k, buffers)` are the
static slicing that stage k's `lax.switch` branch does (DESIGN.md,
heterogeneous stages in SPMD). One mechanism serves parameters, gradients,
optimizer state, boundary activations and kept residuals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Buffers = dict  # dtype name -> array whose last axis is the packed length


@dataclasses.dataclass(frozen=True)
class _Leaf:
    dtype: str
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where every leaf of every stage's tree lives in the per-dtype buffers."""

    treedefs: tuple[Any, ...]  # one PyTreeDef per stage
    leaves: tuple[tuple[_Leaf, ...], ...]  # per stage, per leaf
    lengths: tuple[tuple[str, int], ...]  # dtype -> padded length, sorted by dtype

    @classmethod
    def of(cls, trees: Sequence[Any]) -> "Packing":
        """Build from one tree of arrays or `ShapeDtypeStruct`s per stage."""
        treedefs, leaves, lengths = [], [], {}
        for tree in trees:
            flat, treedef = jax.tree.flatten(tree)
            used: dict[str, int] = {}
            stage = []
            for x in flat:
                dtype = str(np.dtype(x.dtype))
                stage.append(_Leaf(dtype, used.get(dtype, 0), tuple(x.shape)))
                used[dtype] = used.get(dtype, 0) + stage[-1].size
            for dtype, n in used.items():
                lengths[dtype] = max(lengths.get(dtype, 0), n)
            treedefs.append(treedef)
            leaves.append(tuple(stage))
        return cls(tuple(treedefs), tuple(leaves),
                   tuple(sorted((d, n) for d, n in lengths.items() if n > 0)))

    @property
    def stages(self) -> int:
        return len(self.treedefs)

    def zeros(self, lead: tuple[int, ...] = ()) -> Buffers:
        """Zero buffers with leading axes `lead` (e.g. `(K,)` or `(capacity,)`)."""
        return {d: jnp.zeros((*lead, n), d) for d, n in self.lengths}

    def abstract_tree(self, k: int) -> Any:
        """Stage k's tree of `ShapeDtypeStruct`s."""
        return jax.tree.unflatten(self.treedefs[k], [jax.ShapeDtypeStruct(s.shape, s.dtype)
                                                     for s in self.leaves[k]])

    def pack(self, k: int, tree: Any) -> Buffers:
        """Stage k's tree as flat, zero-padded buffers."""
        flat = jax.tree.leaves(tree)
        parts: dict[str, list] = {d: [] for d, _ in self.lengths}
        for spec, x in zip(self.leaves[k], flat):
            parts[spec.dtype].append(jnp.ravel(x).astype(spec.dtype))
        out = {}
        for d, n in self.lengths:
            used = sum(p.size for p in parts[d])
            if used < n:
                parts[d].append(jnp.zeros((n - used,), d))
            out[d] = jnp.concatenate(parts[d]) if len(parts[d]) > 1 else parts[d][0]
        return out

    def unpack(self, k: int, buffers: Buffers) -> Any:
        """Stage k's tree from its flat buffers (static slices)."""
        flat = [buffers[s.dtype][s.offset:s.offset + s.size].reshape(s.shape)
                for s in self.leaves[k]]
        return jax.tree.unflatten(self.treedefs[k], flat)

    def used_bytes(self, k: int) -> int:
        return sum(s.size * np.dtype(s.dtype).itemsize for s in self.leaves[k])

    def padded_bytes(self) -> int:
        """Bytes of one stage's buffers (every stage holds this much)."""
        return sum(n * np.dtype(d).itemsize for d, n in self.lengths)
