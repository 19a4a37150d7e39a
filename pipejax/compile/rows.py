"""One row of a ring buffer read and written where the values live.

A ring of kept residuals (or of the B→W bridge) is a set of slot buffers
with a leading ring axis, packed like a stage's tree (packing.py). The
forward writes its residuals into row `g·v + c mod capacity` inside the
branch that computes them, each leaf as far as it reaches: XLA then fuses
the write with the leaf's producer, where `pack` and a row update made the
row in a buffer of its own and copied it into the ring. The backward reads
the row inside its branch, each leaf sliced where it is used. The rings
travel through the ops' loop carries, updated in place (table.py).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from pipejax.packing import Buffers, Packing


def write(packing: Packing, k: int, rings: Buffers, row: Any, tree: Any) -> Buffers:
    """`rings` with stage k's tree written into row `row` of its own slots
    (no padding written); the other slots pass through."""
    out = list(rings)
    for spec, x in zip(packing.leaves[k], jax.tree.leaves(tree)):
        ring = out[spec.slot]
        value = packing.to_slot(spec, x).astype(ring.dtype)
        out[spec.slot] = lax.dynamic_update_slice(ring, value[None], (row, *(0,) * value.ndim))
    return tuple(out)


def read(packing: Packing, k: int, rings: Buffers, row: Any) -> Any:
    """Stage k's tree from row `row` of `rings` (the inverse of `write`)."""
    flat = []
    for spec in packing.leaves[k]:
        ring = rings[spec.slot]
        sizes = (1, packing.reach(spec), *ring.shape[2:]) if ring.ndim > 1 else (1,)
        part = lax.dynamic_slice(ring, (row, *(0,) * (ring.ndim - 1)), sizes)
        flat.append(packing.from_slot(spec, part[0]))
    return jax.tree.unflatten(packing.treedefs[k], flat)
