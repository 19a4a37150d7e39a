"""How far `pj.search`'s predictions hold.

staleness  The `stable` flag (the delay in effective steps, η/(1 − m)·D, at
           most `STABLE_DELAY`) against what `benchmarks/convergence.py`
           measured (`results/convergence.json`): for each configuration
           there (model, K, micro-batch, rate, momentum), whether PB and
           PB + LWP_D + SC_D end more than 2 points of test accuracy below
           synchronous SGDM (mean over the seeds). The delay is recomputed
           from the schedule's table and the run's rate and momentum.
memory     Predicted bytes per device against the compiled step's
           (argument + output − aliased + temp) for candidates across
           schedules, remat and virtual stages, two MLPs and a GPT at K = 4,
           and the asynchronous tables at K = 1 on 8 data replicas.
sharded    The same for the GPT's stages split over tensor = 2 by its
           annotations, and over fsdp = 2 × tensor = 2, at K = 2 (GPipe,
           1F1B, zb-h1 and PB, both remat settings).
search     The seconds of one search: an NNX GPT of 2 blocks (width 32, 2
           heads, context 32) on 8 devices, batch 32, stages {1, 2, 4} ×
           fsdp [1, 2] × tensor [1, 2], 1F1B, GPipe and zb-h1, both remat
           settings: 228 configurations. Once as a process runs it (a stage's
           code traced and compiled once for all its candidates) and once
           with the process's memories emptied before each configuration
           (`pj.clear_caches`), what a process that kept none would pay. One
           row at a time, each skipped when the JSON has it.
time       Predicted step time against the measured one on the 4 simulated
           CPU devices, for `TIMED` candidates of a GPT spread evenly over
           the predicted ranking of every candidate (K ∈ {1, 2, 4}, data ×
           stages = 4, batch 64). The machine is measured first, apart from
           the candidates: the rate of the processor the devices share (a
           plain data-parallel jit of the model's gradient over the 4
           devices, past its layers' fixed cost; measured again in the
           candidates' rounds, and the predictions made again at that rate),
           a layer's fixed cost (the GPT at K = 1 on the 4 devices as
           replicas, its batch in 1 and in 16 micro-batches: what the 15
           more passes over the layers add, `host.layer_seconds`), the fixed
           cost of a tick (a 4-stage 1F1B step of layers of width 4, whose
           arithmetic is nothing), the copy rate of a message and the rate
           of the memory as the rings use it (`host.ring_rate`). Reported:
           Spearman's rank correlation and the relative error of each
           candidate, and the correlation and errors of the same steps
           predicted without the ring traffic, and without the layers'
           fixed cost (at the plain gradient's average rate).
cores      Predicted step time against the cores benchmark's (each table on
           K pinned cores of their own, `bench_cpu.json` "cores", fastest
           calls), per model and M: Spearman's rank correlation and the
           relative errors.

Run: python benchmarks/planner.py [--part staleness memory sharded search time cores]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import itertools
import json
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from common import RESULTS, agreement, load, save, table
from pipejax import planner
from pipejax.bench import core_models, peak_bytes
from pipejax.planner import host
from pipejax.timing import alternate, stepper

LOST = 2.0  # points of test accuracy below SGDM that count as not training


def staleness() -> list[dict]:
    runs = load("convergence")["runs"]
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    settings: dict[tuple, dict] = {}
    for r in runs:
        if r["table"] == "trainer":
            continue  # the same configuration through pipe.trainer, one seed
        config = (r["model"], r["micro_batch"], round(r["momentum"], 6),
                  tuple(map(str, r["hyper"])))  # SGDM has no delay: one run for every K
        K = 0 if r["row"] == "SGDM, no delay" else r["K"]
        groups[(*config, K)][r["row"]].append(100 * r["test_accuracy"])
        if r["row"] == "PB":
            settings[(*config, K)] = r
    out = []
    for config, rows in groups.items():
        if config not in settings or "SGDM, no delay" not in groups[(*config[:-1], 0)]:
            continue
        r, rows = settings[config], {**groups[(*config[:-1], 0)], **rows}
        schedule = pj.schedules.make_schedule("pb", pj.Placement(r["K"]), 2 * r["K"])
        delay = planner.effective_delay(schedule, r["micro_batch"], r["learning_rate"],
                                        r["momentum"], None)
        sgdm = float(np.mean(rows["SGDM, no delay"]))
        row = {"model": r["model"], "K": r["K"], "micro_batch": r["micro_batch"],
               "learning_rate": r["learning_rate"], "momentum": round(r["momentum"], 6),
               "effective_delay": round(delay, 4), "stable": delay <= planner.STABLE_DELAY,
               "SGDM": round(sgdm, 1)}
        for name, label in (("PB", "PB"), ("PB + LWP_D + SC_D", "recipe")):
            if name not in rows:
                continue
            loss = sgdm - float(np.mean(rows[name]))
            row[f"{label} lost"] = round(loss, 1)
            row[f"{label} trains"] = loss <= LOST
            row[f"flag right ({label})"] = row["stable"] == (loss <= LOST)
        out.append(row)
    return sorted(out, key=lambda r: (r["effective_delay"], r["model"], r["momentum"]))


# (schedule, remat, stages): at K = 4 on 4 devices, M = 8 (interleaved and the
# V tables at v = 2); the asynchronous tables also at K = 1 on 8 data replicas, M = 1.
CASES = [(s, r, 4) for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev",
                             "pipedream", "pb") for r in ("stage", "none")]
CASES += [(s, "stage", 1) for s in ("pipedream", "pb")]


def memory() -> list[dict]:
    models = {"MLP 8x256": (pj.models.mlp(depth=8, width=256), jnp.zeros((40,)), None,
                            pj.losses.cross_entropy),
              "MLP 16x512": (pj.models.mlp(depth=16, width=512), jnp.zeros((40,)), None,
                             pj.losses.cross_entropy),  # weights outweigh activations
              "GPT 6x64": _gpt_model()}
    return [row for name, model in models.items()
            for schedule, remat, K in CASES
            for row in _memory_row(name, model, schedule, remat, K)]


def sharded() -> list[dict]:
    """The GPT's stages split over tensor = 2 (Megatron's annotations) and
    over fsdp = 2 × tensor = 2, at K = 2."""
    return [row for schedule, remat in SHARDED for F in (1, 2)
            for row in _memory_row("GPT 6x64", _gpt_model(), schedule, remat, 2, F, 2)]


SHARDED = [(s, r) for s in ("gpipe", "1f1b", "zb-h1", "pb") for r in ("stage", "none")]


SEARCH = dict(machine=planner.Machine(devices=8),
              space=planner.Space(stages=[1, 2, 4], fsdp=[1, 2], tensor=[1, 2],
                                  schedules=["1f1b", "gpipe", "zb-h1"]))


def search() -> list[dict]:
    """How long `pj.search` takes (module docstring), kept and forgotten."""
    from flax import nnx

    path = RESULTS / "planner.json"
    rows = json.loads(path.read_text()).get("search", []) if path.exists() else []
    for memories in ("kept", "forgotten before each configuration"):
        if any(r["memories"] == memories for r in rows):
            continue
        pj.clear_caches()
        layers = pj.models.gpt(depth=2, width=32, heads=2, context=32, api="nnx",
                               rngs=nnx.Rngs(0))
        x, tried = jnp.zeros((32,), jnp.int32), []

        def progress(i: int, total: int) -> None:
            tried.append(total)
            if memories != "kept":
                pj.clear_caches()

        start = time.perf_counter()
        found = planner.search(layers, loss=pj.losses.next_token, example=x, targets=x,
                               training=planner.Training(batch=32, optimizer=optax.adamw(1e-3)),
                               progress=progress, **SEARCH)
        rows.append({"memories": memories, "configurations": tried[-1],
                     "candidates": len(found), "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
        results = json.loads(path.read_text()) if path.exists() else {}
        results.pop("environment", None)
        save("planner", {**results, "search": rows})  # a row at a time: it runs in parts
    return rows


def _gpt_model() -> tuple:
    return (pj.models.gpt(depth=6, width=64, heads=4, context=32), jnp.zeros((32,), jnp.int32),
            jnp.zeros((32,), jnp.int32), pj.losses.next_token)


def _memory_row(name: str, model: tuple, schedule: str, remat: str, K: int, F: int = 1,
                T: int = 1) -> list[dict]:
    """The predicted and compiled bytes of the best candidate of one setting
    (none where the search finds none: PB without remat)."""
    layers, example, targets, loss = model
    devices = (4 if K > 1 else 8) if F * T == 1 else K * F * T
    found = planner.search(layers, loss=loss, example=example, targets=targets,
                           machine=planner.Machine(devices=devices),
                           training=planner.Training(batch=64, optimizer=optax.adam(1e-3)),
                           space=planner.Space(schedules=[schedule], stages=[K], fsdp=[F],
                                               tensor=[T], microbatches=[8 if K > 1 else 1],
                                               remat=[remat]))
    if not found:
        return []  # e.g. PB without remat: its backward runs on newer weights
    c = found[0]
    stack = lambda a: jnp.zeros((c.microbatch, *a.shape), a.dtype)
    pipe = pj.pipeline(layers, loss=loss, example=stack(example),
                       targets=None if targets is None else stack(targets), **c.pipeline_args())
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    n = c.microbatches * c.microbatch * c.data
    x = jnp.zeros((n, *example.shape), example.dtype)
    y = jnp.zeros((n,), jnp.int32) if targets is None else jnp.zeros(
        (n, *targets.shape), targets.dtype)
    compiled = peak_bytes(trainer.step.lower(state, (x, y)).compile())
    row = {"model": name, "schedule": schedule, "remat": remat, "K": K, "replicas": c.data,
           "virtual": c.virtual, **({"fsdp": F, "tensor": T} if F * T > 1 else {}),
           "predicted_MiB": round(c.memory_bytes / 2**20, 3),
           "compiled_MiB": round(compiled / 2**20, 3),
           "error_%": round(100 * (c.memory_bytes / compiled - 1), 1)}
    print(row, flush=True)
    return [row]


GPT, DEVICES, TIMED, REPEATS = host.GPT, 4, 16, host.REPEATS
BATCH = host.batch(DEVICES)


def machine() -> dict:
    """The simulated host's constants (`pipejax.planner.host.measure`), and
    the GPT's FLOPs a step."""
    m = host.measure(DEVICES)
    return {"host_flops": m.host_flops, "tick_seconds": m.tick_seconds,
            "link_bandwidth": m.link_bandwidth, "memory_bandwidth": m.memory_bandwidth,
            "layer_seconds": m.layer_seconds,
            "model_gflop_per_step": host.gradient_flops(DEVICES) / 1e9}


def _search(consts: dict) -> list:
    """Every candidate of the GPT on the machine `consts`, fastest first."""
    example = jnp.zeros((GPT["context"],), jnp.int32)
    found = planner.search(pj.models.gpt(**GPT), loss=pj.losses.next_token, example=example,
                           targets=example,
                           machine=planner.Machine(devices=DEVICES,
                                                   device_flops=consts["host_flops"],
                                                   link_bandwidth=consts["link_bandwidth"],
                                                   tick_seconds=consts["tick_seconds"],
                                                   host_flops=consts["host_flops"],
                                                   memory_bandwidth=consts["memory_bandwidth"],
                                                   layer_seconds=consts["layer_seconds"]),
                           training=planner.Training(batch=BATCH))
    return sorted(found, key=lambda c: c.step_seconds)


def step_time() -> dict:
    """Predicted against measured step time, `TIMED` GPT candidates. The
    processor's rate is measured again in the candidates' rounds (the
    shared machine's load moves between rounds more than between
    candidates), and the predictions are made at that rate."""
    consts = machine()
    print(consts, flush=True)
    found = _search(consts)
    picked = [found[round(i)] for i in np.linspace(0, len(found) - 1, TIMED)]
    layers = pj.models.gpt(**GPT)
    x, y = host.gpt_batch(BATCH)
    runs = {}
    for i, c in enumerate(picked):
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:c.microbatch],
                           targets=y[:c.microbatch], **c.pipeline_args())
        trainer = pipe.trainer(optax.adam(1e-3))
        runs[i] = stepper(trainer, trainer.init(pipe.init(jax.random.key(0))), (x, y))
    plain, flops = host.plain_gradient(DEVICES)
    measured = alternate({**runs, "plain": plain}, REPEATS)
    large = float(np.median(measured["plain"]))
    consts["host_flops"] = host.rate(flops, large, consts["layer_seconds"], DEVICES)
    key = lambda c: (c.schedule, c.stages, c.data, c.fsdp, c.tensor, c.virtual, c.microbatches,
                     c.remat, c.compute_dtype)  # the configuration, not its predictions
    again = {key(c): c for c in _search(consts)}
    picked = [again[key(c)] for c in picked]
    # the same steps predicted without the ring traffic, and without the
    # layers' fixed cost (the rate then the plain gradient's average), for comparison
    flops_only = {key(c): c for c in _search({**consts, "memory_bandwidth": float("inf")})}
    unfixed = {key(c): c for c in _search({**consts, "layer_seconds": 0.0,
                                           "host_flops": flops / large})}
    rows, seconds = [], [float(np.median(measured[i])) for i in range(len(picked))]
    for i, c in enumerate(picked):
        rows.append({"schedule": c.schedule, "K x R": f"{c.stages} x {c.data}", "v": c.virtual,
                     "M x mb": f"{c.microbatches} x {c.microbatch}", "remat": c.remat,
                     "predicted_ms": round(1e3 * c.step_seconds, 1),
                     "measured_ms": round(1e3 * seconds[i], 1),
                     "error_%": round(100 * (c.step_seconds / seconds[i] - 1), 1)})
        print(rows[-1], flush=True)
    without = [flops_only[key(c)].step_seconds for c in picked]
    return {"machine": {k: float(f"{v:.4g}") for k, v in consts.items()}, "rows": rows,
            "candidates_searched": len(found),
            **agreement([c.step_seconds for c in picked], seconds),
            "without ring traffic": agreement(without, seconds),
            "without the layers' fixed cost": agreement(
                [unfixed[key(c)].step_seconds for c in picked], seconds)}


def cores() -> dict:
    """`pj.search`'s step against the cores benchmark's (`bench_cpu.json`,
    "cores": each table on K pinned cores of their own, fastest calls), on
    a machine of separate devices: a device's rate the plain jit's on one
    pinned core (its traced FLOPs over its fastest step), the tick's fixed
    cost and the rates of the link and the memory as `time` measured them
    (the processes' link is gloo, not that copy)."""
    measured = [r for r in load("bench_cpu").get("cores", []) if "least_ms" in r]
    machine = load("planner")["time"]["machine"]
    by = lambda r: (r["model"], r["M"])
    rows, out = [], {}
    for (name, M), group in itertools.groupby(sorted(measured, key=by), key=by):
        model, group = core_models.models()[name], list(group)
        x, y = model.batch(model.micro)
        loss = getattr(pj.losses, model.loss)
        plan = pj.pipeline(model.layers(), loss=loss, example=x, targets=y, stages=1,
                           microbatches=1).plan
        rate = M * sum(s.flops or 0.0 for s in plan.stage_specs(0)) / (
            group[0]["plain_least_ms"] / 1e3)
        rates = {name: machine[name] for name in ("link_bandwidth", "tick_seconds",
                                                  "memory_bandwidth", "layer_seconds")}
        predicted = [planner.search(
            model.layers(), loss=loss, example=x[0], targets=y[0],
            machine=planner.Machine(devices=r["K"], device_flops=rate, **rates),
            training=planner.Training(batch=M * model.micro),
            space=planner.Space(schedules=[r["schedule"]], stages=[r["K"]], microbatches=[M],
                                remat=[r["remat"]]))[0].step_seconds for r in group]
        for r, seconds in zip(group, predicted):
            rows.append({"model": name, "M": M, "schedule": r["schedule"], "remat": r["remat"],
                         "predicted_ms": round(1e3 * seconds, 1), "measured_ms": r["least_ms"],
                         "error_%": round(100 * (1e3 * seconds / r["least_ms"] - 1), 1)})
            print(rows[-1], flush=True)
        out[f"{name} M={M}"] = agreement(predicted, [r["least_ms"] / 1e3 for r in group])
    return {"rows": rows, **out}


def tables() -> dict[str, str]:
    """The planner page's sentences on split stages and on the search's
    own time, from the JSON."""
    results = load("planner") if (RESULTS / "planner.json").exists() else {}
    return {"sharded": _sharded_sentence(results.get("sharded", [])),
            "search": _search_sentence(results.get("search", [])),
            "cores": _cores_sentence(results.get("cores", {}))}


def _cores_sentence(result: dict) -> str:
    groups = {k: v for k, v in result.items() if k != "rows"}
    if not groups:
        return ""
    each = "; ".join(f"{k}: Spearman {v['spearman']}, mean error {v['mean |error| %']} %"
                     for k, v in groups.items())
    low = sum(r["error_%"] < 0 for r in result["rows"])
    return (f"`python benchmarks/planner.py --part cores`, every table of the cores benchmark "
            f"(K = 2 pinned cores of their own) predicted and measured: {each}. "
            f"{low} of {len(result['rows'])} steps took longer than predicted.")


def _search_sentence(rows: list[dict]) -> str:
    by = {r["memories"]: r for r in rows}
    if len(by) < 2:
        return ""
    kept, forgotten = by["kept"], by["forgotten before each configuration"]
    return (f"`python benchmarks/planner.py --part search`: an NNX GPT of 2 blocks on 8 simulated "
            f"devices, batch 32, stages 1, 2 and 4 × fsdp [1, 2] × tensor [1, 2], 1F1B, GPipe "
            f"and zb-h1, both remat settings: {kept['configurations']} configurations in "
            f"{kept['seconds']:.0f} s ({kept['candidates']} candidates); with the memories "
            f"emptied before each configuration, {forgotten['seconds']:.0f} s "
            f"({forgotten['seconds'] / kept['seconds']:.1f}× as long).")


def _sharded_sentence(rows: list[dict]) -> str:
    if not rows:
        return ""
    err = lambda r: f"{r['error_%']:+.1f} %"
    within = [r for r in rows if abs(r["error_%"]) <= 5]
    outside = [r for r in rows if abs(r["error_%"]) > 5]
    span = lambda rs: f"{min(r['error_%'] for r in rs):+.1f} to {max(r['error_%'] for r in rs):+.1f} %"
    named = "; ".join(f"{r['schedule']} remat \"{r['remat']}\" at fsdp {r['fsdp']} × tensor "
                      f"{r['tensor']}: {err(r)}" for r in outside)
    return (
        f"Split stages (`python benchmarks/planner.py --part sharded`, the GPT 6x64 at K = 2 "
        f"over tensor = 2 and over fsdp = 2 × tensor = 2; GPipe, 1F1B, zb-h1 and PB, both remat "
        f"settings; {len(rows)} candidates): {len(within)} within {span(within)}"
        + (f", and {named}" if outside else "") + ". A split stage's working set is its "
        "backward compiled alone on one group of T tensor devices, each parameter split as "
        "annotated and each kept residual as XLA splits it (the kept ring holds a device's "
        "heads and hidden units alone).")


PARTS = {"staleness": staleness, "memory": memory, "sharded": sharded, "search": search,
         "time": step_time, "cores": cores}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="*", default=list(PARTS), choices=list(PARTS))
    args = p.parse_args()
    path = RESULTS / "planner.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.pop("environment", None)
    for part in args.part:
        results[part] = PARTS[part]()
        print(table(results[part]["rows"] if part in ("time", "cores") else results[part]))
    if "staleness" in results:
        rows = results["staleness"]
        results["staleness_summary"] = {
            f"flag right ({label})": f"{sum(r[f'flag right ({label})'] for r in rows if key in r)} "
                                     f"of {sum(key in r for r in rows)}"
            for label in ("PB", "recipe") for key in [f"flag right ({label})"]}
    for part in ("memory", "sharded"):
        if part in results:
            errors = [abs(r["error_%"]) for r in results[part]]
            results[f"{part}_summary"] = {"candidates": len(errors), "mean |error| %":
                                          round(float(np.mean(errors)), 1),
                                          "max |error| %": max(errors)}
    save("planner", {**results, "stable_delay": planner.STABLE_DELAY})
    for key in ("staleness_summary", "memory_summary", "sharded_summary"):
        if key in results:
            print(key, results[key])
    for part in ("time", "cores"):
        if part in results:
            print({k: v for k, v in results[part].items() if k != "rows"})


if __name__ == "__main__":
    main()
