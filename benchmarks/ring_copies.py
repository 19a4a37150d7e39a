"""The copies of an asynchronous step: PipeDream with and
without weight stashing, and PB (MLP 8x512, K = 4, M = 8, micro-batch 32,
Adam), counted in `compiled.as_text()` by `pipejax.bench.hlo.tick_copies`:
those of the tick itself, which run at every tick, and those inside its
0-or-1-trip loops (the forward, the backward and each stage group's update),
which run when the loop does: copies of a ring, of one of its rows
(activation-sized: a message, a micro-batch's kept residuals) or of a packed
parameter slot (weight-sized; or a ring of them, the stashed weights). The
synchronous tables' copies are `table_speed.py`'s.
Run: python benchmarks/ring_copies.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from pipejax.bench import hlo
from common import save, table


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
        found = hlo.tick_copies(text, pipe.schedule.ticks, hlo.buffer_shapes(pipe.layout))
        rows.append({"schedule": schedule, "weight_stashing": stash, "remat": remat,
                     **{f"{where}_copies": len(b) for where, b in found.items()},
                     **{f"{where}_mb": round(sum(b) / 2**20, 2) for where, b in found.items()}})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    rows = asynchronous()
    print(table(rows))
    save("ring_copies_asynchronous", {"model": "MLP 8x512", "K": 4, "microbatches": 8,
                                      "microbatch": 32, "optimizer": "adam", "rows": rows})


if __name__ == "__main__":
    main()
