"""Every schedule on the one table interpreter: ticks, bubble, stash, memory, compile time.

For each schedule at K ∈ {2, 4, 8} stages and M ∈ {8, 32} micro-batches, on
a 16-layer MLP (width 256, micro-batch 16): ticks per step, bubble fraction
(one step; for the asynchronous ones also over 32 steps), ring-buffer slots
for stage inputs, output gradients, kept values and (zero bubble) the B→W
bridge, compiled `temp_size_in_bytes` of the training step and the bytes
of its rings (which the trainer's state carries, outside the temp), and its
compile time. The virtual-stage and zero-bubble tables: interleaved and GPipe over v = 2
chunks per device, zb-h1 and zb-h2 at v = 1 and zb-h1 at v = 2, and on the V
placement zb-v and dualpipev.
Acceptance: 1F1B's memory (temp and rings) is below GPipe's at K = 4, M = 16; a
zero-bubble step executes 1F1B's FLOPs within 5 % (table × each op's XLA
FLOPs, `pipejax.bench.op_costs`); compile time against M.

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
from common import load, markdown, save, table
from pipejax.bench.op_costs import op_counts
from pipejax.planner.paths import critical_path, executed

FEATURES, MB = 40, 16


def _pipe(schedule: str, K: int, M: int, v: int = 1, remat: str = "stage") -> pj.Pipeline:
    layers = pj.models.mlp(depth=15, width=256, classes=10)  # 16 Dense layers
    return pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, FEATURES)),
                       stages=K, microbatches=M, schedule=schedule, virtual=v, remat=remat)


def measure(schedule: str, K: int, M: int, v: int = 1, remat: str = "stage") -> dict:
    pipe = _pipe(schedule, K, M, v, remat)
    trainer = pipe.trainer(optax.sgd(0.01))
    state = trainer.init(pipe.init(jax.random.key(0)))
    x = jnp.zeros((M * MB, FEATURES))
    y = jnp.zeros((M * MB,), jnp.int32)
    start = time.perf_counter()
    compiled = trainer.step.lower(state, (x, y)).compile()
    seconds = time.perf_counter() - start
    s = pipe.schedule
    slots = pj.schedules.ring_capacities(s)
    return {"schedule": schedule, "v": v, "K": K, "M": M, "remat": remat, "ticks": s.ticks,
            "bubble": round(pj.schedules.bubble_fraction(s), 4),
            "bubble_32_steps": round(pj.schedules.bubble_fraction(s, 32), 4),
            "input_slots": slots.inputs, "grad_slots": slots.grads,
            "kept_slots": slots.residuals, "bridge_slots": slots.bridge,
            "delays": str(s.delays), "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "ring_bytes": sum(a.size * a.dtype.itemsize
                              for a in jax.tree.leaves(jax.eval_shape(pipe.layout.rings))),
            "compile_s": round(seconds, 2)}


CASES = [(s, 1) for s in ("gpipe", "1f1b", "pipedream", "pb", "zb-h1", "zb-h2")] + \
    [(s, 2) for s in ("gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev")]


def flops(K: int = 4, M: int = 16) -> list[dict]:
    """Executed and lock-step critical-path FLOPs of one step, from the table
    and each op's FLOPs, relative to 1F1B's (per-op costs of each pipeline's
    own split: v = 2 chunks are half stages)."""
    rows = []
    base = None
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved", 2),
                        ("zb-h1", 2), ("zb-v", 2), ("dualpipev", 2)):
        pipe = _pipe(schedule, K, M, v)
        costs = op_counts(pipe.build.code)
        total, path = executed(pipe.schedule, costs), critical_path(pipe.schedule, costs)
        base = base or (total, path)
        rows.append({"schedule": schedule, "v": v, "K": K, "M": M,
                     "executed_gflop": round(total / 1e9, 4),
                     "executed_vs_1f1b": round(total / base[0], 4),
                     "critical_path_gflop": round(path / 1e9, 4),
                     "critical_path_vs_1f1b": round(path / base[1], 4)})
    return rows


def _name(r: dict) -> str:
    placed = " (V placement)" if r["schedule"] in ("zb-v", "dualpipev") else ""
    return r["schedule"] + (f", v = {r['v']}" if r["v"] > 1 and not placed else "") + placed


def tables() -> dict[str, str]:
    """The reproductions page's tables from schedules.json: every table at
    K = 4, M = 8, and the work of each at K = 4, M = 16."""
    result = load("schedules")
    rows = [{"schedule": _name(r), "ticks": r["ticks"],
             "bubble (1 step / 32 steps)": f"{r['bubble']:.3f} / {r['bubble_32_steps']:.3f}",
             "input / gradient / kept / bridge slots":
                 f"{r['input_slots']} / {r['grad_slots']} / {r['kept_slots']} / {r['bridge_slots']}",
             "delays": r["delays"], "compiled temp memory": f"{r['temp_bytes'] / 1e6:.2f} MB",
             "rings": f"{r['ring_bytes'] / 1e6:.2f} MB"}
            for r in result["rows"] if (r["K"], r["M"]) == (4, 8)]
    work = [{"schedule": _name(r),
             "executed GFLOP (/ 1F1B)": f"{r['executed_gflop']:.3f} ({r['executed_vs_1f1b']:.3f})",
             "lock-step critical path GFLOP (/ 1F1B)":
                 f"{r['critical_path_gflop']:.3f} ({r['critical_path_vs_1f1b']:.3f})"}
            for r in result["flops"]]
    return {"k4_m8": markdown(rows), "work": markdown(work)}


def main() -> None:
    rows = [measure(s, K, M, v) for K in (2, 4, 8) for M in (8, 32) for s, v in CASES]
    check = {s: (row := measure(s, 4, 16))["temp_bytes"] + row["ring_bytes"]
             for s in ("gpipe", "1f1b")}
    print(table(rows))
    print(f"\nK=4, M=16: temp and ring bytes 1F1B {check['1f1b']} < GPipe {check['gpipe']}: "
          f"{check['1f1b'] < check['gpipe']}")
    compile_ratio = {f"{s}, v={v}": round(
        next(r["compile_s"] for r in rows if (r["schedule"], r["v"], r["K"], r["M"]) == (s, v, 4, 32))
        / next(r["compile_s"] for r in rows if (r["schedule"], r["v"], r["K"], r["M"]) == (s, v, 4, 8)),
        2) for s, v in CASES}
    print(f"compile time M=32 / M=8 at K=4: {compile_ratio}")
    # What the B→W bridge costs: with remat "stage" B replays the forward and
    # bridges the layer inputs W reads; with "none" they were kept anyway.
    remat = [measure(s, 4, 16, v, r) for r in ("stage", "none")
             for s, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-h1", 2),
                          ("zb-v", 2), ("dualpipev", 2))]
    print()
    print(table([{k: r[k] for k in ("schedule", "v", "remat", "kept_slots", "bridge_slots",
                                    "ring_bytes", "temp_bytes")} for r in remat]))
    work = flops()
    print()
    print(table(work))
    result = {"rows": rows, "k4_m16_held_bytes": check, "k4_m16_by_remat": remat, "flops": work,
              "compile_m32_over_m8_k4": compile_ratio}
    print(f"wrote {save('schedules', result)}")


if __name__ == "__main__":
    main()
