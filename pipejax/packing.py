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

A leaf split over T tensor devices (its axis d, layers/sharding.py) lives
in a slot of its own kind, `(m, T)`: column t holds the t-th of the T
blocks of axis d, flattened (the part device t computes with), so the slot
is split over `tensor` along its last axis, and over `fsdp` along its
first. Such leaves of every stage rank by size as the others do, so a
heterogeneous stage list packs them with the same padding; unpacking is a
slice, a reshape and a move of the T axis next to d, which XLA partitions
without communication (the T axis stays the major part of the merged
axis). Leaves no annotation splits are whole on every tensor device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax.errors import ConfigError
from pipejax.mesh import constrain

Buffers = tuple  # one array per slot; its trailing axes are the slot's shape


def _pad_rows(b: Any, rows: int) -> Any:
    """`b` with zero rows appended up to `rows`."""
    extra = rows - b.shape[0]
    return b if extra == 0 else _xp(b).pad(b, ((0, extra),) + ((0, 0),) * (b.ndim - 1))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    slot: int
    shape: tuple[int, ...]
    tensor_axis: int | None = None  # the axis split over `tensor` (slot (m, T)); None: whole

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def block(self, T: int) -> tuple[int, ...]:
        """The shape of one tensor device's block of the leaf."""
        return tuple(n // T if i == self.tensor_axis else n for i, n in enumerate(self.shape))


def _xp(x: Any) -> Any:
    """numpy for host arrays (checkpoints, `per_stage`), jax.numpy for the rest."""
    return np if isinstance(x, np.ndarray) else jnp


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
    tensor: int = 1  # T, the tensor devices a split leaf's slot (m, T) is split over
    tied: tuple = ()  # leaves that hold one value (tied weights): (stage, leaf) groups

    @classmethod
    def of(cls, trees: Sequence[Any], order: Sequence[int] | None = None,
           fsdp: int = 1, tensor_axes: Sequence[Sequence[int | None]] | None = None,
           tensor: int = 1) -> "Packing":
        """Build from one tree of arrays or `ShapeDtypeStruct`s per stage
        (`order`: see the field); with `fsdp` = F > 1 every slot flat, its
        length a multiple of F (see `shard`); with `tensor` = T > 1,
        `tensor_axes` gives each stage's leaves' axes split over it (None:
        whole), and those leaves get slots (m, T)."""
        flats, treedefs = zip(*(jax.tree.flatten(t) for t in trees)) if trees else ((), ())
        if tensor == 1 or tensor_axes is None:
            tensor_axes = [[None] * len(flat) for flat in flats]
        ranked: list[dict[int, tuple[str, bool, int]]] = []  # leaf -> (dtype, split?, rank)
        lengths: dict[tuple[str, bool, int], int] = {}
        shapes: dict[tuple[str, bool, int], set] = {}
        for flat, axes in zip(flats, tensor_axes):
            kinds: dict[tuple[str, bool], list[int]] = {}
            for i, x in enumerate(flat):
                kinds.setdefault((str(np.dtype(x.dtype)), axes[i] is not None), []).append(i)
            stage = {}
            for (dtype, over), idx in kinds.items():
                idx.sort(key=lambda i: -int(np.prod(flat[i].shape, dtype=np.int64)))
                for rank, i in enumerate(idx):
                    key = stage[i] = (dtype, over, rank)
                    size = int(np.prod(flat[i].shape, dtype=np.int64)) // (tensor if over else 1)
                    lengths[key] = max(lengths.get(key, 0), size)
                    shapes.setdefault(key, set()).add(tuple(flat[i].shape))
            ranked.append(stage)
        index = {s: j for j, s in enumerate(sorted(lengths))}
        leaves = tuple(tuple(_Leaf(index[stage[i]], tuple(x.shape), axes[i])
                             for i, x in enumerate(flat))
                       for flat, axes, stage in zip(flats, tensor_axes, ranked))
        # One shape in every stage that uses the slot (and no stage without
        # it): keep it; else a flat buffer as long as the longest leaf.
        kept = lambda key: (fsdp == 1 and not key[1] and len(shapes[key]) == 1
                            and all(key in stage.values() for stage in ranked))
        flat = lambda n, over: (-(-n // fsdp) * fsdp, *((tensor,) if over else ()))
        slots = tuple((key[0], next(iter(shapes[key])) if kept(key) else flat(n, key[1]))
                      for key, n in sorted(lengths.items()))
        in_order = order is None or list(order) == sorted(order)
        return cls(tuple(treedefs), leaves, slots, None if in_order else tuple(order), tensor)

    def shard(self, n: int) -> "Packing":
        """One device's piece of every slot when each is split into `n`
        equal pieces (a packing made with `fsdp=n`): the same leaves, each
        seen as its piece, shaped (1, ..., 1, length / n) so that it keeps
        its leaf's rank (an optimizer's mask by rank, e.g. weight decay on
        matrices only, decides as it would on the whole leaf); a scalar
        leaf is seen as a vector, its piece."""
        if n == 1:
            return self
        if any(len(shape) != 1 + self.tensor_slots[j] or shape[0] % n
               for j, (_, shape) in enumerate(self.slots)):
            raise ConfigError(f"a packing made without fsdp={n} cannot be split {n} ways")
        slots = tuple((d, (shape[0] // n, *shape[1:])) for d, shape in self.slots)

        def view(s: _Leaf) -> _Leaf:
            # A split leaf's piece: (1, ..., 1, T·c), split over `tensor` on its last axis.
            rank = max(len(s.shape), 1)
            length = int(np.prod(slots[s.slot][1], dtype=np.int64))
            return _Leaf(s.slot, (1,) * (rank - 1) + (length,),
                         None if s.tensor_axis is None else rank - 1)

        leaves = tuple(tuple(view(s) for s in stage) for stage in self.leaves)
        return dataclasses.replace(self, leaves=leaves, slots=slots)

    @property
    def stages(self) -> int:
        return len(self.treedefs)

    @functools.cached_property
    def tensor_slots(self) -> tuple[bool, ...]:
        """Whether each slot holds leaves split over `tensor` (its shape is (m, T))."""
        split = {s.slot for stage in self.leaves for s in stage if s.tensor_axis is not None}
        return tuple(j in split for j in range(len(self.slots)))

    @property
    def lengths(self) -> tuple[int, ...]:
        """Elements of each slot."""
        return tuple(int(np.prod(shape, dtype=np.int64)) for _, shape in self.slots)

    def zeros(self, lead: tuple[int, ...] = ()) -> Buffers:
        """Zero buffers with leading axes `lead` (e.g. `(K,)` or `(capacity,)`)."""
        return tuple(jnp.zeros((*lead, *shape), d) for d, shape in self.slots)

    def empty(self, lead: tuple[int, ...] = ()) -> Buffers:
        """Buffers like `zeros` of any content (`lax.empty`), for rings
        whose every slot is written before it is read."""
        return tuple(lax.empty((*lead, *shape), d) for d, shape in self.slots)

    def abstract_tree(self, k: int) -> Any:
        """Stage k's tree of `ShapeDtypeStruct`s."""
        return jax.tree.unflatten(self.treedefs[k], [
            jax.ShapeDtypeStruct(s.shape, self.slots[s.slot][0]) for s in self.leaves[k]])

    def pack(self, k: int, tree: Any) -> Buffers:
        """Stage k's tree as zero-padded slot buffers (numpy arrays, on the
        host, for a tree of numpy arrays)."""
        out: list[Any] = [None] * len(self.slots)
        leaves = jax.tree.leaves(tree)
        xp = np if leaves and all(isinstance(x, np.ndarray) for x in leaves) else jnp  # host
        for spec, x in zip(self.leaves[k], leaves):
            dtype, shape = self.slots[spec.slot]
            b = self.to_slot(spec, xp.asarray(x)).astype(dtype)
            out[spec.slot] = b if b.shape == shape else _pad_rows(b, shape[0])
        return tuple(xp.zeros(shape, d) if b is None else b
                     for b, (d, shape) in zip(out, self.slots))

    def add(self, k: int, buffers: Buffers, tree: Any, first: int) -> Buffers:
        """`buffers` with `tree`'s leaves added into the slots of stage k's
        leaves `first`, `first` + 1, ... (one chunk of the stage): the other
        slots pass through, so a loop that carries `buffers` updates only
        these in place."""
        out = list(buffers)
        for spec, x in zip(self.leaves[k][first:], jax.tree.leaves(tree)):
            b = out[spec.slot]
            v = self.to_slot(spec, jnp.asarray(x)).astype(b.dtype)
            if v.shape == b.shape:
                out[spec.slot] = b + v
            elif spec.tensor_axis is not None:
                out[spec.slot] = constrain(constrain(b, 1).at[:v.shape[0]].add(v), 1)
            else:
                out[spec.slot] = b.at[:v.shape[0]].add(v)
        return tuple(out)

    def unpack(self, k: int, buffers: Buffers) -> Any:
        """Stage k's tree from its slot buffers (a reshape when the leaf fills its slot)."""
        return jax.tree.unflatten(self.treedefs[k],
                                  [self.from_slot(s, buffers[s.slot]) for s in self.leaves[k]])

    def to_slot(self, s: _Leaf, x: Any) -> Any:
        """Leaf `s` as its slot holds it, unpadded (its first `reach(s)`
        rows): its columns where split over `tensor`, itself where it fills
        the slot's shape, else flat."""
        if s.tensor_axis is not None:
            return self._columns(s, x)
        x = self._whole(x)
        return x if s.shape == self.slots[s.slot][1] else _xp(x).ravel(x)

    def from_slot(self, s: _Leaf, b: Any) -> Any:
        """Leaf `s` from its slot's buffer `b`, or from its first `reach(s)` rows."""
        if s.tensor_axis is not None:
            return self._leaf(s, b)
        if s.shape != b.shape:
            b = (b if s.size == b.shape[0] else b[:s.size]).reshape(s.shape)
        return self._whole(b)

    def reach(self, s: _Leaf) -> int:
        """The rows of its slot that leaf `s` fills."""
        shape = self.slots[s.slot][1]
        return (s.size // self.tensor if s.tensor_axis is not None else
                shape[0] if s.shape == shape else s.size)

    def _whole(self, x: Any) -> Any:
        """A leaf no annotation splits, whole on every tensor device before
        it is packed: XLA may have computed it split (the gradient of a
        bias after a split matrix), and padding a split axis moves data
        between devices (a collective-permute, which hangs on CPU inside a
        stage's branch: it waits for every stage's devices)."""
        return constrain(x, None) if self.tensor > 1 else x

    def _columns(self, s: _Leaf, x: Any) -> Any:
        """A split leaf as (size / T, T): column t its t-th block along axis
        `s.tensor_axis`, flattened (the inverse of `_leaf`)."""
        xp, d, T = _xp(x), s.tensor_axis, self.tensor
        blocks = xp.reshape(x, (*s.shape[:d], T, s.shape[d] // T, *s.shape[d + 1:]))
        return constrain(xp.moveaxis(blocks, d, -1).reshape(-1, T), 1)

    def _leaf(self, s: _Leaf, b: Any) -> Any:
        """A split leaf from its slot (m, T): the first size / T rows, each
        column a block, moved back next to axis `s.tensor_axis`."""
        xp, block = _xp(b), s.block(self.tensor)
        rows = int(np.prod(block, dtype=np.int64))
        b = constrain(b, 1)
        b = b if rows == b.shape[0] else b[:rows]
        return constrain(xp.moveaxis(b.reshape(*block, self.tensor), -1, s.tensor_axis)
                         .reshape(s.shape), s.tensor_axis)

    def structure(self, k: int) -> tuple:
        """Stage k's tree structure and slots, comparable with == (equal for
        stages whose trees pack alike)."""
        return self.treedefs[k], self.leaves[k]

    def slot_bytes(self) -> int:
        """Bytes of one stage's buffers on one device (every stage holds
        this much; a slot split over `tensor`: its column)."""
        return sum(n // (self.tensor if split else 1) * np.dtype(d).itemsize
                   for (d, _), n, split in zip(self.slots, self.lengths, self.tensor_slots))

    def padding(self) -> float:
        """Bytes of every stage's buffers over the stages' own bytes, minus
        one (0.0: no padding)."""
        real = sum(self.used_bytes(k) for k in range(self.stages))
        return self.stages * self.slot_bytes() / real - 1.0 if real else 0.0

    def used_bytes(self, k: int) -> int:
        """Bytes of stage k's own leaves on one device, without padding (a
        leaf split over `tensor`: its block)."""
        return sum(s.size // (1 if s.tensor_axis is None else self.tensor)
                   * np.dtype(self.slots[s.slot][0]).itemsize for s in self.leaves[k])
