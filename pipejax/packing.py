"""Pack each stage's pytree into flat buffers that have one shape on every stage.

Stages of a heterogeneous model have different parameter (and optimizer
state, activation, residual) trees, yet SPMD needs one array shape on every
device (heterogeneous stages in SPMD). A `Packing` gives every
leaf of every stage a *slot*: a flat buffer of one dtype, as long as the
largest leaf any stage puts there. Within a dtype, each stage's leaves are
ranked by size, and the j-th largest leaf of every stage shares slot j; so
stages of identical structure need no padding, and a leaf that fills its slot
is unpacked by a free reshape instead of a copied slice (the copy would cost
a pass over all weights at every tick). A slot whose leaves have one shape
on every stage keeps that shape (at K = 1, and for stages of one structure,
every slot): a reshape between the packed and the leaf's shape, free as it
is, makes XLA fuse an update twice (measured: a momentum update read its
state twice, 6 % more bytes than plain jit on the MLP). `pack(k, tree)` and
`unpack(k, buffers)` are the static reshapes that stage k's `lax.switch`
branch does. One mechanism serves parameters, gradients, optimizer state,
boundary activations and kept residuals.

A stage sharded over F devices (FSDP) packs every leaf flat, each slot
padded to a multiple of F, so that device f holds the f-th of F equal
pieces of every slot (`shard`): one slot holds one leaf of a stage, so
a piece is part of one leaf, and a per-leaf optimizer runs on pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.errors import ConfigError

Buffers = tuple  # one array per slot; its trailing axes are the slot's shape


@dataclasses.dataclass(frozen=True)
class _Leaf:
    slot: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class Packing:
    """Which slot every leaf of every stage's tree lives in."""

    treedefs: tuple[Any, ...]  # one PyTreeDef per stage
    leaves: tuple[tuple[_Leaf, ...], ...]  # per stage, per leaf
    slots: tuple[tuple[str, tuple[int, ...]], ...]  # per slot: (dtype, shape)
    # A parameter packing whose stage trees are lists of layers: the global
    # index of each item, stage after stage, where they are not in layer
    # order (virtual stages); None when they are.
    order: tuple[int, ...] | None = None

    @classmethod
    def of(cls, trees: Sequence[Any], order: Sequence[int] | None = None,
           shards: int = 1) -> "Packing":
        """Build from one tree of arrays or `ShapeDtypeStruct`s per stage
        (`order`: see the field); with `shards` > 1 every slot flat, its
        length a multiple of `shards` (see `shard`)."""
        flats, treedefs = zip(*(jax.tree.flatten(t) for t in trees)) if trees else ((), ())
        ranked: list[dict[int, tuple[str, int]]] = []  # per stage: leaf -> (dtype, rank)
        lengths: dict[tuple[str, int], int] = {}
        shapes: dict[tuple[str, int], set] = {}
        for flat in flats:
            by_dtype: dict[str, list[int]] = {}
            for i, x in enumerate(flat):
                by_dtype.setdefault(str(np.dtype(x.dtype)), []).append(i)
            stage = {}
            for dtype, idx in by_dtype.items():
                idx.sort(key=lambda i: -int(np.prod(flat[i].shape, dtype=np.int64)))
                for rank, i in enumerate(idx):
                    stage[i] = (dtype, rank)
                    size = int(np.prod(flat[i].shape, dtype=np.int64))
                    lengths[dtype, rank] = max(lengths.get((dtype, rank), 0), size)
                    shapes.setdefault((dtype, rank), set()).add(tuple(flat[i].shape))
            ranked.append(stage)
        index = {s: j for j, s in enumerate(sorted(lengths))}
        leaves = tuple(tuple(_Leaf(index[stage[i]], tuple(x.shape)) for i, x in enumerate(flat))
                       for flat, stage in zip(flats, ranked))
        # One shape in every stage that uses the slot (and no stage without
        # it): keep it; else a flat buffer as long as the longest leaf.
        kept = lambda d, r: (shards == 1 and len(shapes[d, r]) == 1
                             and all((d, r) in stage.values() for stage in ranked))
        flat = lambda n: (-(-n // shards) * shards,)
        slots = tuple((d, next(iter(shapes[d, r])) if kept(d, r) else flat(lengths[d, r]))
                      for d, r in sorted(lengths))
        in_order = order is None or list(order) == sorted(order)
        return cls(tuple(treedefs), leaves, slots, None if in_order else tuple(order))

    def shard(self, n: int) -> "Packing":
        """One device's piece of every slot when each is split into `n`
        equal pieces (a packing made with `shards=n`): the same leaves, each
        seen as its piece, shaped (1, ..., 1, length / n) so that it keeps
        its leaf's rank (an optimizer's mask by rank, e.g. weight decay on
        matrices only, decides as it would on the whole leaf); a scalar
        leaf is seen as a vector, its piece."""
        if n == 1:
            return self
        if any(len(shape) != 1 or shape[0] % n for _, shape in self.slots):
            raise ConfigError(f"a packing made without shards={n} cannot be split {n} ways")
        slots = tuple((d, (shape[0] // n,)) for d, shape in self.slots)
        view = lambda s: _Leaf(s.slot, (1,) * (max(len(s.shape), 1) - 1) + slots[s.slot][1])
        leaves = tuple(tuple(view(s) for s in stage) for stage in self.leaves)
        return dataclasses.replace(self, leaves=leaves, slots=slots)

    @property
    def stages(self) -> int:
        return len(self.treedefs)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Elements of each slot."""
        return tuple(int(np.prod(shape, dtype=np.int64)) for _, shape in self.slots)

    def zeros(self, lead: tuple[int, ...] = ()) -> Buffers:
        """Zero buffers with leading axes `lead` (e.g. `(K,)` or `(capacity,)`)."""
        return tuple(jnp.zeros((*lead, *shape), d) for d, shape in self.slots)

    def abstract_tree(self, k: int) -> Any:
        """Stage k's tree of `ShapeDtypeStruct`s."""
        return jax.tree.unflatten(self.treedefs[k], [
            jax.ShapeDtypeStruct(s.shape, self.slots[s.slot][0]) for s in self.leaves[k]])

    def pack(self, k: int, tree: Any) -> Buffers:
        """Stage k's tree as zero-padded slot buffers."""
        out: list[Any] = [None] * len(self.slots)
        for spec, x in zip(self.leaves[k], jax.tree.leaves(tree)):
            dtype, shape = self.slots[spec.slot]
            if spec.shape == shape:
                out[spec.slot] = jnp.asarray(x).astype(dtype)
                continue
            flat, n = jnp.ravel(x).astype(dtype), shape[0]
            out[spec.slot] = flat if spec.size == n else jnp.pad(flat, (0, n - spec.size))
        return tuple(jnp.zeros(shape, d) if b is None else b
                     for b, (d, shape) in zip(out, self.slots))

    def add(self, k: int, buffers: Buffers, tree: Any, first: int) -> Buffers:
        """`buffers` with `tree`'s leaves added into the slots of stage k's
        leaves `first`, `first` + 1, ... (one chunk of the stage): the other
        slots pass through, so a loop that carries `buffers` updates only
        these in place."""
        out = list(buffers)
        for spec, x in zip(self.leaves[k][first:], jax.tree.leaves(tree)):
            dtype, shape = self.slots[spec.slot]
            x = jnp.asarray(x).astype(dtype)
            b = out[spec.slot]
            out[spec.slot] = b + x if spec.shape == shape else b.at[:spec.size].add(jnp.ravel(x))
        return tuple(out)

    def unpack(self, k: int, buffers: Buffers) -> Any:
        """Stage k's tree from its slot buffers (a reshape when the leaf fills its slot)."""
        flat = []
        for s in self.leaves[k]:
            b, shape = buffers[s.slot], self.slots[s.slot][1]
            if s.shape != shape:
                b = (b if s.size == shape[0] else b[:s.size]).reshape(s.shape)
            flat.append(b)
        return jax.tree.unflatten(self.treedefs[k], flat)

    def structure(self, k: int) -> tuple:
        """Stage k's tree structure and slots, comparable with == (equal for
        stages whose trees pack alike)."""
        return self.treedefs[k], self.leaves[k]

    def slot_bytes(self) -> int:
        """Bytes of one stage's buffers (every stage holds this much)."""
        return sum(n * np.dtype(d).itemsize for (d, _), n in zip(self.slots, self.lengths))

    def padding(self) -> float:
        """Bytes of every stage's buffers over the stages' own bytes, minus
        one (0.0: no padding)."""
        real = sum(self.used_bytes(k) for k in range(self.stages))
        return self.stages * self.slot_bytes() / real - 1.0 if real else 0.0

    def used_bytes(self, k: int) -> int:
        """Bytes of stage k's own leaves, without padding."""
        return sum(s.size * np.dtype(self.slots[s.slot][0]).itemsize for s in self.leaves[k])
