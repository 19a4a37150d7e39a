"""One row of a ring buffer read and written where the values live.

A ring of kept residuals (or of the B→W bridge) is a set of slot buffers
with a ring axis, packed like a stage's tree (packing.py). The forward
writes its residuals into row `g·v + c mod capacity` inside the branch that
computes them, each leaf as far as it reaches: XLA then fuses the write
with the leaf's producer, where `pack` and a row update made the row in a
buffer of its own and copied it into the ring. The backward reads the row
inside its branch, each leaf sliced where it is used. The rings travel
through the ops' loop carries, updated in place (table.py).

A slot split over `tensor` (its shape (m, T)) is a ring (n·m, T), row r at
rows r·m..: a ring (n, m, T) is (n, m, 1) on each tensor device, and XLA's
layout assignment gave the loop's carry and the step's argument two
layouts of that size-one axis, copying each such ring twice a step (the
zoo GPT 6x64 at tensor 2, GPipe without remat: 10.9 MiB of copies in a
24.2 MiB step; two dimensions, as the parameter slots are, copy nothing).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from pipejax.packing import Buffers, Packing


def shapes(packing: Packing, n: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dtype, shape) of each slot's ring of `n` rows."""
    return tuple((d, (n * shape[0], shape[1]) if split else (n, *shape))
                 for (d, shape), split in zip(packing.slots, packing.tensor_slots))


def ring(packing: Packing, n: int, lead: tuple[int, ...] = (), empty: bool = False) -> Buffers:
    """A ring of `n` rows of every slot, with leading axes `lead`: zeros, or
    with `empty` buffers of any content (`lax.empty`)."""
    fill = lax.empty if empty else jax.numpy.zeros
    return tuple(fill((*lead, *shape), d) for d, shape in shapes(packing, n))


def write(packing: Packing, k: int, rings: Buffers, row: Any, tree: Any) -> Buffers:
    """`rings` with stage k's tree written into row `row` of its own slots
    (no padding written); the other slots pass through."""
    out = list(rings)
    for spec, x in zip(packing.leaves[k], jax.tree.leaves(tree)):
        ring, split = out[spec.slot], packing.tensor_slots[spec.slot]
        value = packing.to_slot(spec, x).astype(ring.dtype)
        if split:
            start = (row * packing.slots[spec.slot][1][0], 0)
        else:
            value, start = value[None], (row, *(0,) * value.ndim)
        out[spec.slot] = lax.dynamic_update_slice(ring, value, start)
    return tuple(out)


def read(packing: Packing, k: int, rings: Buffers, row: Any) -> Any:
    """Stage k's tree from row `row` of `rings` (the inverse of `write`)."""
    flat = []
    for spec in packing.leaves[k]:
        ring, reach = rings[spec.slot], packing.reach(spec)
        if packing.tensor_slots[spec.slot]:
            start = row * packing.slots[spec.slot][1][0]
            part = lax.dynamic_slice(ring, (start, 0), (reach, ring.shape[1]))
        else:
            sizes = (1, reach, *ring.shape[2:]) if ring.ndim > 1 else (1,)
            part = lax.dynamic_slice(ring, (row, *(0,) * (ring.ndim - 1)), sizes)[0]
        flat.append(packing.from_slot(spec, part))
    return jax.tree.unflatten(packing.treedefs[k], flat)
