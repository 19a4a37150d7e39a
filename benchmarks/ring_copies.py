"""Bytes of the `copy` instructions in a compiled training step: where XLA
copies the ring buffers of kept residuals inside the step's loop instead of
updating them in place.

The language model of `lm_table.py` (16 layers, 16 micro-batches of 4
windows of 128 bytes): 1F1B at K = 4 and 8 and zb-h1 at K = 4 with each remat
mode. Counted in `compiled.as_text()`: every `copy` with its shape's bytes,
once per instruction (a copy inside the loop body runs at every tick).

`--asynchronous`: the weight-sized copies of an asynchronous step (MLP
8x512, K = 4, M = 8, micro-batch 32, Adam: PipeDream with and without
weight stashing, PB) inside the scan over ticks: those of the tick itself,
which run at every tick, and those inside its 0-or-1-trip loops (the
forward, the backward and each stage group's update), which run when the
loop does. Weight-sized: the shape of a packed parameter slot.
Run: python benchmarks/ring_copies.py [--asynchronous]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
from pipejax.bench import hlo
import lm_table as L
import optax
from common import save, table

COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")


def copies(text: str) -> list[int]:
    """The bytes of every `copy` instruction of an HLO text, largest first."""
    return sorted((hlo.nbytes(dtype, dims) for dtype, dims in COPY.findall(text) if dims),
                  reverse=True)


def tick_copies(text: str, ticks: int, shapes: set[str]) -> dict[str, list[int]]:
    """The bytes of the copies of `shapes` (e.g. "f32[512,512]") in the
    body of the scan over `ticks` ticks ("tick": they run at every tick)
    and in the computations it calls ("loops")."""
    comps = hlo.computations(text)
    body = hlo.tick_body(comps, ticks)
    sized = lambda name: [hlo.nbytes(d, dims) for d, dims in COPY.findall(comps[name])
                          if f"{d}[{dims}]" in shapes]
    return {"tick": sized(body),
            "loops": [b for n in hlo.reachable(comps, body) - {body} for b in sized(n)]}


def asynchronous() -> list[dict]:
    """Weight-sized copies per tick of the asynchronous steps (module docstring)."""
    K, M, mb = 4, 8, 32
    x = jax.random.normal(jax.random.key(1), (M * mb, 40))
    y = jax.random.randint(jax.random.key(2), (M * mb,), 0, 10)
    rows = []
    for schedule, stash, remat in (("pipedream", True, "none"), ("pipedream", False, "stage"),
                                   ("pb", False, "stage")):
        pipe = pj.pipeline(pj.models.mlp(depth=8, width=512), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((mb, 40)), stages=K, microbatches=M,
                           schedule=schedule, remat=remat, weight_stashing=stash)
        trainer = pipe.trainer(optax.adam(1e-3))
        state = trainer.init(pipe.init(jax.random.key(0)))
        text = trainer.step.lower(state, (x, y)).compile().as_text()
        slots = {f"{d.replace('float', 'f')}[{','.join(map(str, shape))}]"
                 for d, shape in pipe.layout.params.slots}
        found = tick_copies(text, pipe.schedule.ticks, slots)
        rows.append({"schedule": schedule, "weight_stashing": stash, "remat": remat,
                     **{f"{where}_copies": len(b) for where, b in found.items()},
                     **{f"{where}_mb": round(sum(b) / 2**20, 2) for where, b in found.items()}})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asynchronous", action="store_true",
                        help="the asynchronous steps' weight-sized copies per tick")
    if parser.parse_args().asynchronous:
        rows = asynchronous()
        print(table(rows))
        save("ring_copies_asynchronous", {"model": "MLP 8x512", "K": 4, "microbatches": 8,
                                          "microbatch": 32, "optimizer": "adam", "rows": rows})
        return
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
