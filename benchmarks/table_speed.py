"""Every synchronous table against 1F1B and a plain jit, alternated in one process.

Models: the zoo GPT (`pj.models.gpt(depth=14, width=128, heads=4,
context=128)`: 16 layers, so that K = 8 with v = 2 has a layer per chunk;
M = 8 micro-batches of 4 windows, AdamW) at K = 2, 4 and 8, and the MLP
8x512 (M = 8 micro-batches of 32, AdamW) at K = 4, and at width 8
("tiny-4"), where the arithmetic is next to nothing and a step is its
ticks' fixed cost (the "ms a tick" column). The GPT at K = 1 runs the
tables that place one chunk a device: with neither a bubble nor ticks in
lock step, what separates zero bubble from 1F1B there is the split's own
cost. For each (model, K) a group of rows runs alternated
(`pipejax.bench.speed.alternate`): the plain
`jax.jit` of the same micro-batches (a scan over them, one update; one
device) and every synchronous table with remat "stage" and "none". Per row:
the median step time, its ratio to the plain jit and to 1F1B at the same
remat (medians of the per-round ratios), the bytes a device's ops read
and write in a step (`pipejax.bench.op_costs.step_count`: XLA's cost
analysis counts a loop's body once, so each op is compiled alone and
counted as often as the table runs it), the temp memory per device, and
the buffers the table interpreter copies
(`pipejax.bench.hlo.tick_copies`: at every tick, and in the ops' loops).

On four or eight simulated CPU devices sharing two cores an idle tick
costs nothing, so each row's limit is its own arithmetic and how its ticks
share the cores (`--cores 1` leaves the work alone): remat "none" does
three quarters of remat "stage"'s, and every table does the same work as
1F1B. The GPT at K = 2 has a core a device, as devices of their own: there
a device that waits for another (the bubble, a tick's slowest op) idles
its core.

Groups already in the JSON are skipped, so the table can be made in parts.
Run: python benchmarks/table_speed.py [--group gpt-4] [--repeats 6] [--cores 1 --out F]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from common import RESULTS, load, markdown, save, table
from pipejax.bench import hlo
from pipejax.bench.op_costs import step_count
from pipejax.bench.speed import plain_steps
from pipejax.timing import alternate
from pipejax.schedules import FAMILIES

PATH = RESULTS / "table_speed.json"
M = 8
TABLES = [name for name, family in FAMILIES.items() if not family.asynchronous]
REMATS = ("stage", "none")


def _model(name: str):
    """(layers, loss, example micro-batch, targets) of a benchmark model."""
    if name == "gpt":
        tokens = jnp.zeros((4, 128), jnp.int32)
        return (pj.models.gpt(depth=14, width=128, heads=4, context=128), pj.losses.next_token,
                tokens, tokens)
    return (pj.models.mlp(depth=8, width=8 if name == "tiny" else 512), pj.losses.cross_entropy,
            jnp.zeros((32, 40)), jnp.zeros((32,), jnp.int32))


GROUPS = {"gpt-4": ("gpt", 4), "gpt-8": ("gpt", 8), "mlp-4": ("mlp", 4), "gpt-1": ("gpt", 1),
          "gpt-2": ("gpt", 2), "tiny-4": ("tiny", 4)}


def _batch(example, targets):
    key = jax.random.key(1)
    if example.dtype == jnp.int32:
        x = jax.random.randint(key, (M * example.shape[0], *example.shape[1:]), 0, 256)
        return x, jnp.roll(x, -1, axis=1)
    x = jax.random.normal(key, (M * example.shape[0], *example.shape[1:]))
    return x, jax.random.randint(jax.random.key(2), (x.shape[0],), 0, 10)


def _opt():
    return optax.adamw(1e-3, weight_decay=0.1)


def group(name: str, repeats: int, tables: list[str], remats: tuple[str, ...]) -> list[dict]:
    """The rows of one (model, K), alternated."""
    model, K = GROUPS[name]
    layers, loss, example, targets = _model(model)
    batch = _batch(example, targets)
    opt = _opt()
    runs, held, info = {}, {}, {}
    for schedule in [t for t in tables if K > 1 or FAMILIES[t].search_virtual == 1]:
        for remat in remats:
            pipe = pj.pipeline(layers, loss=loss, example=example, targets=targets, stages=K,
                               microbatches=M, schedule=schedule, remat=remat,
                               virtual=FAMILIES[schedule].search_virtual)
            trainer = pipe.trainer(opt)
            key = f"{schedule} {remat}"
            held[key] = trainer.init(pipe.init(jax.random.key(0)))
            compiled = trainer.step.lower(held[key], batch).compile()
            found = hlo.tick_copies(compiled.as_text(), pipe.schedule.ticks,
                                    hlo.buffer_shapes(pipe.layout))
            step_bytes = step_count(pipe.schedule, pipe.build.code, "bytes accessed") / K
            info[key] = {"schedule": schedule, "v": pipe.schedule.placement.virtual, "remat": remat,
                         "gb_step": round(step_bytes / 1e9, 3),
                         "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 2**20,
                                          1),
                         **{f"{w}_copies": len(b) for w, b in found.items()},
                         **{f"{w}_copy_mb": round(sum(b) / 2**20, 2) for w, b in found.items()}}

            def run(key=key, step=trainer.step):
                held[key], metrics = step(held[key], batch)
                jax.block_until_ready(metrics["loss"])
            runs[key] = run
            print(info[key], flush=True)
    variables = pj.unstage(held[next(iter(held))])
    plain = jax.jit(plain_steps(layers, M, opt, ("plain_microbatched",), loss)[
        "plain_microbatched"])
    held["plain"] = (variables, opt.init(variables))

    def run_plain():
        v, s, value = plain(*held["plain"], *batch)
        held["plain"] = (v, s)
        jax.block_until_ready(value)
    times = alternate({"plain": run_plain, **runs}, repeats)
    rows = []
    for key, row in info.items():
        ratio = lambda other: round(float(np.median(times[key] / times[other])), 3)
        rows.append({"group": name, "model": model, "K": K, **row,
                     "step_ms": round(float(np.median(times[key])) * 1e3, 1),
                     "plain_ms": round(float(np.median(times["plain"])) * 1e3, 1),
                     "over_plain": ratio("plain"),
                     "over_1f1b": ratio(f"1f1b {row['remat']}") if f"1f1b {row['remat']}" in times
                     else None})
    return rows


def _line(row: dict) -> dict:
    """A row as the page's table shows it, with its table's ticks."""
    ticks = FAMILIES[row["schedule"]].table(row["K"], M, row["v"]).ticks
    return {"table": row["schedule"] + (f" (v = {row['v']})" if row["v"] > 1 else ""),
            "remat": row["remat"], "ticks": ticks, "ms": row["step_ms"],
            "ms a tick": round(row["step_ms"] / ticks, 3), "× 1F1B": row["over_1f1b"],
            "× plain jit": row["over_plain"], "GB a step": row["gb_step"],
            "temp MB": row["temp_mb"],
            "copies a tick (MB)": f"{row['tick_copies']} ({row['tick_copy_mb']})",
            "copies in loops (MB)": f"{row['loops_copies']} ({row['loops_copy_mb']})"}


def tables() -> dict[str, str]:
    """The language-model page's tables, one per group: each row's step
    time, its ratio to 1F1B at the same remat and to the plain jit, the
    bytes its ops move a step per device, temp memory and copies; from
    table_speed.json, and with "_one_core" from the run on one core
    (`--cores 1 --group gpt-4 --group mlp-4 --tables
    gpipe,1f1b,zb-h1,zb-h2,zb-v,dualpipev --out
    benchmarks/results/table_speed_one_core.json`)."""
    out = {}
    for suffix, name in (("", "table_speed"), ("_one_core", "table_speed_one_core")):
        rows = load(name)["rows"] if (RESULTS / f"{name}.json").exists() else []
        for group in GROUPS:
            lines = [_line(r) for r in rows if r["group"] == group]
            out[group.replace("-", "_") + suffix] = markdown(lines) if lines else ""
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=list(GROUPS), action="append")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--tables", default=",".join(TABLES))
    parser.add_argument("--remat", default=",".join(REMATS))
    parser.add_argument("--out", default=str(PATH), help="the JSON (rows of a group there are "
                        "kept and the group skipped)")
    parser.add_argument("--cores", type=int, help="run on this many of the machine's cores (on "
                        "one, no device waits for another's core: a row's ratio is its work)")
    args = parser.parse_args()
    if args.cores:  # before JAX starts its threads, which inherit the mask
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    out = os.path.abspath(args.out)
    rows = json.loads(open(out).read())["rows"] if os.path.exists(out) else []
    for name in args.group or list(GROUPS):
        if any(r["group"] == name for r in rows):
            continue
        rows += group(name, args.repeats, args.tables.split(","), tuple(args.remat.split(",")))
        print(table([r for r in rows if r["group"] == name]), flush=True)
        payload = {"microbatches": M, "optimizer": "adamw", "rows": rows}
        if os.path.dirname(out) == os.path.abspath(RESULTS):  # with the machine and the command
            save(os.path.basename(out).removesuffix(".json"), payload)
        else:
            open(out, "w").write(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
