"""What a weight forecast costs the pipelined executor (PB, K = 4).

For each mitigation, on a 16-layer MLP (width 256, micro-batch 16, M = 8):
the compiled step's temp bytes and argument bytes (the train state: the
difference-form forecast keeps the last update, one weight-sized buffer per
stage), and the median step time, each over the same run without mitigation.
The forecast itself is computed inside the forward (an element-wise pass
over the stage's weights) and, for SpecTrain, again in the backward.

Run: python benchmarks/forecast_cost.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

import pipejax as pj
from common import median_time, save, table

K, M, MB, FEATURES = 4, 8, 16, 40


def measure(name: str) -> dict:
    mit = pj.transforms.mitigation(name, 0.01)
    pipe = pj.pipeline(pj.models.mlp(depth=15, width=256, classes=10),
                       loss=pj.losses.cross_entropy, example=jnp.zeros((MB, FEATURES)), stages=K,
                       microbatches=M, schedule="pb", weight_stashing=mit.weight_stashing)
    trainer = pipe.trainer(mit.optimizer)
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jax.random.normal(jax.random.key(1), (M * MB, FEATURES)), jnp.zeros(M * MB, jnp.int32))
    memory = trainer.step.lower(state, batch).compile().memory_analysis()

    def step():
        nonlocal state
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])

    for _ in range(5):
        step()
    return {"mitigation": name, "temp_bytes": int(memory.temp_size_in_bytes),
            "argument_bytes": int(memory.argument_size_in_bytes),
            "param_bytes_per_stage": pipe.layout.params.slot_bytes(),
            "step_ms": round(1e3 * median_time(step, 30), 2)}


def main() -> None:
    rows = [measure(n) for n in pj.transforms.MITIGATIONS]
    base = rows[0]
    for r in rows:
        # memory_analysis() is per device, i.e. per stage
        r["extra_state_per_stage_in_weights"] = round(
            (r["argument_bytes"] - base["argument_bytes"]) / base["param_bytes_per_stage"], 2)
        r["temp_over_none"] = round(r["temp_bytes"] / base["temp_bytes"], 3)
        r["step_over_none"] = round(r["step_ms"] / base["step_ms"], 3)
    print(table(rows))
    print(f"wrote {save('forecast_cost', {'K': K, 'M': M, 'micro_batch': MB, 'rows': rows})}")


if __name__ == "__main__":
    main()
