"""Compiled per-device memory of a stage sharded over F fsdp devices
(ZeRO-3) and T tensor devices (the layers' annotations).

For each model, schedule and (F, T) (K = 2 stages, so 2·F·T devices): the
compiled training step's argument bytes per device (parameters, AdamW's
state, the batch; an asynchronous step's in-flight rings too), its temp and
output bytes, the ratio of each to F = T = 1, the predicted total of
`trainer.memory()` against the compiled argument + output + temp, and the
all-gather, reduce-scatter and all-reduce instructions the step holds in
the loop over ticks (each runs at most once a tick) and outside it
(pipejax/bench/hlo.py). Models: the zoo GPT (depth 4, width 256, 4 heads,
context 128, vocabulary 256; micro-batch 8; Megatron's annotations) and an
unannotated heterogeneous MLP (widths 1024, 512, 1536, 256, 10 over 512
features; micro-batch 16; FSDP only), both M = 4 micro-batches. Each row is
written when measured; a rerun skips the rows already there.

Run: python benchmarks/sharding_memory.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from common import load, markdown, save, table
from pipejax.bench import hlo

K, M = 2, 4


def gpt():
    mb, T = 8, 128
    x = jax.random.randint(jax.random.key(0), (M * mb, T), 0, 256)
    layers = pj.models.gpt(depth=4, width=256, heads=4, context=T, vocab=256)
    return layers, pj.losses.next_token, (x, jnp.roll(x, -1, axis=1)), mb


def mlp():
    mb = 16
    x = jax.random.normal(jax.random.key(0), (M * mb, 512))
    layers = [nn.Dense(1024), nn.relu, nn.Dense(512), nn.gelu, nn.Dense(1536), nn.relu,
              nn.LayerNorm(), nn.Dense(256), nn.relu, nn.Dense(10)]
    return layers, pj.losses.cross_entropy, (x, jnp.zeros((M * mb,), jnp.int32)), mb


def row(model: str, schedule: str, F: int, gather: str, T: int) -> dict:
    layers, loss, (x, y), mb = {"gpt": gpt, "mlp": mlp}[model]()
    pipe = pj.pipeline(layers, loss=loss, example=x[:mb], targets=y[:mb], stages=K,
                       microbatches=M, schedule=schedule, mesh=pj.make_mesh(K, fsdp=F, tensor=T),
                       fsdp_gather=gather)
    trainer = pipe.trainer(optax.adamw(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    compiled = trainer.step.lower(state, (x, y)).compile()
    memory, text = compiled.memory_analysis(), compiled.as_text()
    compiled_total = (memory.argument_size_in_bytes + memory.output_size_in_bytes
                      + memory.temp_size_in_bytes)
    gathers = hlo.per_tick(text, pipe.schedule.ticks, "all-gather")
    scatters = hlo.per_tick(text, pipe.schedule.ticks, "reduce-scatter")
    reduces = hlo.per_tick(text, pipe.schedule.ticks, "all-reduce")
    return {"model": model, "schedule": schedule, "fsdp": F, "tensor": T, "gather": gather,
            "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "predicted_total_bytes": trainer.memory().total, "compiled_total_bytes": compiled_total,
            "param_slots": len(pipe.layout.params.slots),
            "gathers_per_tick": gathers["tick"], "gathers_per_step": gathers["step"],
            "scatters_per_tick": scatters["tick"], "scatters_per_step": scatters["step"],
            "all_reduces_per_tick": reduces["tick"], "all_reduces_per_step": reduces["step"]}


def tables() -> dict[str, str]:
    """The sharding page's tables from sharding_memory.json: "memory", per
    device against F and T; "collectives", what a step gathers, scatters
    and reduces."""
    rows = load("sharding_memory")["rows"]
    mb = lambda n: f"{n / 2**20:.1f}"
    memory = [{"model": r["model"], "schedule": r["schedule"], "fsdp_gather": r["gather"],
               "F": r["fsdp"], "T": r["tensor"], "arguments MB": mb(r["argument_bytes"]),
               "× F = T = 1": f"{r['argument_over_unsharded']:.3f}",
               "temp MB": mb(r["temp_bytes"]),
               "temp × F = T = 1": f"{r['temp_over_unsharded']:.3f}",
               "total MB": mb(r["compiled_total_bytes"]),
               "trainer.memory() / compiled": f"{r['predicted_over_compiled']:.2f}"}
              for r in rows]
    collectives = [{"model": r["model"], "schedule": r["schedule"], "fsdp_gather": r["gather"],
                    "F": r["fsdp"], "T": r["tensor"], "parameter slots": r["param_slots"],
                    "all-gathers: in the tick loop / outside": f"{r['gathers_per_tick']} / "
                                                               f"{r['gathers_per_step']}",
                    "reduce-scatters: in the tick loop / outside": f"{r['scatters_per_tick']} / "
                                                                   f"{r['scatters_per_step']}",
                    "all-reduces: in the tick loop / outside": f"{r['all_reduces_per_tick']} / "
                                                               f"{r['all_reduces_per_step']}"}
                   for r in rows if (r["fsdp"], r["tensor"]) in ((2, 1), (1, 2), (2, 2))]
    return {"memory": markdown(memory), "collectives": markdown(collectives)}


LAYOUTS = {"gpt": [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)],  # (F, T)
           "mlp": [(1, 1), (2, 1), (4, 1)]}  # unannotated: fsdp only


def main() -> None:
    try:
        rows = load("sharding_memory")["rows"]
    except FileNotFoundError:
        rows = []
    key = lambda r: (r["model"], r["schedule"], r["gather"], r["fsdp"], r.get("tensor", 1))
    done = {key(r) for r in rows}
    for model, layouts in LAYOUTS.items():
        for schedule, gather in (("1f1b", "tick"), ("1f1b", "step"), ("pb", "tick")):
            for F, T in layouts:
                if (model, schedule, gather, F, T) in done or (gather == "step" and T > 1):
                    continue
                r = row(model, schedule, F, gather, T)
                base = next((b for b in rows if key(b) == (model, schedule, gather, 1, 1)), r)
                for part in ("argument", "temp"):
                    r[f"{part}_over_unsharded"] = round(
                        r[f"{part}_bytes"] / base[f"{part}_bytes"], 3)
                r["predicted_over_compiled"] = round(
                    r["predicted_total_bytes"] / r["compiled_total_bytes"], 3)
                rows.append(r)
                print(r, flush=True)
                save("sharding_memory", {"stages": K, "microbatches": M, "optimizer": "adamw",
                                         "rows": rows})
    print(table(rows))


if __name__ == "__main__":
    main()
