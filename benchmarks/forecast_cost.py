"""What a staleness mitigation costs the pipelined executor (PB, K = 4).

For each mitigation, on a 16-layer MLP (width 256, M = 8) at micro-batch 16
and 128 (the forecast adds one pass over the weights per update, so what it
costs falls as the work per update grows):
the compiled step's temp bytes and argument bytes (the train state: weight
stashing keeps a ring of weight versions), and the median step time, each
over the same run without mitigation. A forward forecast is made by each
update, in the stage's update branch where XLA fuses it with the update, and
carried to the next forward; SpecTrain's backward forecast is made at the
backward. The steps of all mitigations are timed in interleaved rounds; a
ratio is the median over the rounds of that round's ratio, so that the
machine's drift cancels. Wall time and the process's CPU time (all device
threads: the work, which on simulated devices sharing 2 cores the wall time
shows through the stages' waits for each other) are both reported.

Run: python benchmarks/forecast_cost.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import time

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
from common import load, markdown, save, table

K, M, FEATURES, STEPS = 4, 8, 40, 3
ROUNDS = {16: 30, 128: 10}  # micro-batch size: interleaved rounds


def prepare(name: str, mb: int):
    """(row, step): the compiled facts of the mitigation's step and a function
    that runs STEPS steps and blocks."""
    mit = pj.transforms.mitigation(name, 0.01, warmup_steps=1000 if name == "pipemare" else None)
    pipe = pj.pipeline(pj.models.mlp(depth=15, width=256, classes=10),
                       loss=pj.losses.cross_entropy, example=jnp.zeros((mb, FEATURES)), stages=K,
                       microbatches=M, schedule="pb", weight_stashing=mit.weight_stashing)
    trainer = pipe.trainer(mit.optimizer)
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jax.random.normal(jax.random.key(1), (M * mb, FEATURES)), jnp.zeros(M * mb, jnp.int32))
    memory = trainer.step.lower(state, batch).compile().memory_analysis()

    def steps():
        nonlocal state
        for _ in range(STEPS):
            state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics["loss"])

    for _ in range(3):
        steps()
    return {"mitigation": name, "micro_batch": mb, "temp_bytes": int(memory.temp_size_in_bytes),
            "argument_bytes": int(memory.argument_size_in_bytes),
            "param_bytes_per_stage": pipe.layout.params.slot_bytes()}, steps


def measure(mb: int) -> list[dict]:
    """Every mitigation's row at micro-batch mb, timed in interleaved rounds."""
    prepared = [prepare(n, mb) for n in pj.transforms.MITIGATIONS]
    times: list[list[float]] = [[] for _ in prepared]
    cpu: list[list[float]] = [[] for _ in prepared]
    for _ in range(ROUNDS[mb]):
        for i, (_, steps) in enumerate(prepared):
            start, start_cpu = time.perf_counter(), time.process_time()
            steps()
            times[i].append((time.perf_counter() - start) / STEPS)
            cpu[i].append((time.process_time() - start_cpu) / STEPS)
    rows = [row for row, _ in prepared]
    for row, t, c in zip(rows, times, cpu):
        row["step_ms"] = round(1e3 * float(np.median(t)), 2)
        row["cpu_ms"] = round(1e3 * float(np.median(c)), 2)
    base = rows[0]
    for r in rows:
        # memory_analysis() is per device, i.e. per stage
        r["extra_state_per_stage_in_weights"] = round(
            (r["argument_bytes"] - base["argument_bytes"]) / base["param_bytes_per_stage"], 2)
        r["temp_over_none"] = round(r["temp_bytes"] / base["temp_bytes"], 3)
    for r, t, c in zip(rows, times, cpu):  # the median of each round's ratio: drift cancels
        r["step_over_none"] = round(float(np.median(np.array(t) / np.array(times[0]))), 3)
        r["cpu_over_none"] = round(float(np.median(np.array(c) / np.array(cpu[0]))), 3)
    return rows


LABELS = {"lwp": "LWP_D", "lwp+sc": "LWP_D + SC_D", "spectrain": "SpecTrain", "sc": "SC_D",
          "pipemare": "PipeMare", "stash": "weight stashing"}


def tables() -> dict[str, str]:
    """The staleness page's table from forecast_cost.json: each mitigation's
    step time and compiled temp over PB without one, and its extra state."""
    rows = {(r["mitigation"], r["micro_batch"]): r for r in load("forecast_cost")["rows"]}
    sizes = sorted({mb for _, mb in rows})
    return {"rows": markdown([
        {"mitigation": label,
         **{f"step time, mb {mb}": f"×{rows[name, mb]['step_over_none']:.2f}" for mb in sizes},
         f"compiled temp, mb {sizes[0]}": f"×{rows[name, sizes[0]]['temp_over_none']:.2f}",
         "state, in weights per stage": f"{rows[name, sizes[0]]['extra_state_per_stage_in_weights']:g}"}
        for name, label in LABELS.items()])}


def main() -> None:
    rows = [r for mb in ROUNDS for r in measure(mb)]
    print(table(rows))
    print(f"wrote {save('forecast_cost', {'K': K, 'M': M, 'rounds': ROUNDS, 'steps_per_round': STEPS, 'rows': rows})}")


if __name__ == "__main__":
    main()
