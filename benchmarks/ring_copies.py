"""Bytes of the `copy` instructions in a compiled training step: where XLA
copies the ring buffers of kept residuals inside the step's loop instead of
updating them in place.

The language model of `lm_table.py` (16 layers, 16 micro-batches of 4
windows of 128 bytes): 1F1B at K = 4 and 8 and zb-h1 at K = 4 with each remat
mode. Counted in `compiled.as_text()`: every `copy` with its shape's bytes,
once per instruction (a copy inside the loop body runs at every tick).
Run: python benchmarks/ring_copies.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
import lm_table as L
from common import save, table

COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def copies(text: str) -> list[int]:
    """The bytes of every `copy` instruction of an HLO text, largest first."""
    out = []
    for m in COPY.finditer(text):
        if m.group(2):
            out.append(int(np.prod([int(d) for d in m.group(2).split(",")])) * BYTES.get(m.group(1), 4))
    return sorted(out, reverse=True)


def main() -> None:
    layers = pj.models.gpt(**L.SIZE)
    batches, _ = L.data(1)
    rows = []
    for schedule, K in (("1f1b", 4), ("1f1b", 8), ("zb-h1", 4)):
        for remat in ("stage", "none"):
            step, state, _ = L.pipelined(layers, schedule, K, 1, "float32", 10, remat)
            found = copies(step.lower(state, batches[0]).compile().as_text())
            rows.append({"schedule": schedule, "K": K, "remat": remat, "copies": len(found),
                         "copy_mb": round(sum(found) / 2**20, 1),
                         "largest_mb": round(found[0] / 2**20, 2) if found else 0.0})
            print(rows[-1], flush=True)
    print(table(rows))
    save("ring_copies", {"model": L.SIZE, "microbatch": L.MB, "microbatches": L.M, "rows": rows})


if __name__ == "__main__":
    main()
