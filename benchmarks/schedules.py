"""Every schedule on the one table interpreter: ticks, bubble, stash, memory, compile time.

For each schedule at K ∈ {2, 4, 8} stages and M ∈ {8, 32} micro-batches, on
a 16-layer MLP (width 256, micro-batch 16): ticks per step, bubble fraction
(one step; for the asynchronous ones also over 32 steps), ring-buffer slots
for stage inputs and kept values, compiled `temp_size_in_bytes` of the
training step, and its compile time. Acceptance: 1F1B's compiled memory is
below GPipe's at K = 4, M = 16.

Run: python benchmarks/schedules.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time

import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from common import save, table

FEATURES, MB = 40, 16


def measure(schedule: str, K: int, M: int) -> dict:
    layers = pj.models.mlp(depth=15, width=256, classes=10)  # 16 Dense layers
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, FEATURES)),
                       stages=K, microbatches=M, schedule=schedule)
    trainer = pipe.trainer(optax.sgd(0.01))
    state = trainer.init(pipe.init(jax.random.key(0)))
    x = jnp.zeros((M * MB, FEATURES))
    y = jnp.zeros((M * MB,), jnp.int32)
    start = time.perf_counter()
    compiled = trainer.step.lower(state, (x, y)).compile()
    seconds = time.perf_counter() - start
    s = pipe.schedule
    return {"schedule": schedule, "K": K, "M": M, "ticks": s.ticks,
            "bubble": round(s.bubble_fraction, 4),
            "bubble_32_steps": round(s.bubble_fraction_over(32), 4),
            "input_slots": s.input_capacity, "kept_slots": s.residual_capacity,
            "delays": str(s.delays), "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "compile_s": round(seconds, 2)}


def main() -> None:
    rows = [measure(s, K, M) for K in (2, 4, 8) for M in (8, 32)
            for s in ("gpipe", "1f1b", "pipedream", "pb")]
    check = {s: measure(s, 4, 16)["temp_bytes"] for s in ("gpipe", "1f1b")}
    print(table(rows))
    print(f"\nK=4, M=16: temp bytes 1F1B {check['1f1b']} < GPipe {check['gpipe']}: "
          f"{check['1f1b'] < check['gpipe']}")
    print(f"wrote {save('schedules', {'rows': rows, 'k4_m16_temp_bytes': check})}")


if __name__ == "__main__":
    main()
