"""The synchronous schedules on a language model: the same training, every table.

A byte-level GPT (`pj.models.gpt(depth=14, width=128, heads=4, context=128)`:
16 layers, so K = 8 stages hold v = 2 chunks each) trains on Shakespeare's
works (`pj.data.shakespeare`) with AdamW (betas 0.9/0.95, weight decay 0.1
on matrices, 3e-3 after 5 warm-up updates), M = 16 micro-batches of 4
windows a step (8,192 tokens), from one initialization and on the same
windows, for `--steps` steps: as a plain `jax.jit` of the layer list on one
device (a scan over the micro-batches, the reference), as the pipelined
step at K = 1, and at K = 4 and 8 with gpipe, 1f1b, interleaved (v = 2) and
zb-h1; in float32 and with bfloat16 compute (float32 master weights). The
pipelined steps run with `--remat stage` (the library's default: a stage's
forward recomputed in its backward; at K = 1 the forward and backward are
one vjp, the plain jit's work) or `--remat none` (residuals kept in ring
buffers until the backward). Each row: the validation loss
after the same tokens (64 validation windows; every float32 row must agree
with the plain jit to float tolerance), tokens/s (median step of the last
steps), compiled temp memory per device, XLA's bytes accessed of the
compiled step (which counts a loop's body once), compile time.

The performance goals are ratios of two steps alternated in one process
(`pipejax.bench.speed.alternate`): the pipelined step at K = 1 against the
plain jit (goal ≤ 1.05, with equal bytes: `step_bytes`) and K = 8 1f1b against
K = 1 for the same micro-batches (goal ≤ 1.15). On simulated CPU devices
sharing two cores pipelining cannot speed anything up: K = 8 does K = 1's
work plus the bubble's bookkeeping.

Rows already in the JSON are skipped, so the table can be made in parts.
Run: python benchmarks/lm_table.py --remat stage; python benchmarks/lm_table.py --remat none
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from common import RESULTS, load, markdown, save, signed, table
from pipejax.bench.op_costs import step_count
from pipejax.bench.speed import cost
from pipejax.timing import alternate

SIZE = dict(depth=14, width=128, heads=4, context=128)
T, MB, M = SIZE["context"], 4, 16
EVAL_WINDOWS = 64
# (name, schedule, K, v); "plain" is the jax.jit reference.
CONFIGS = [("plain jit", None, 1, 1), ("K=1", "gpipe", 1, 1)] + [
    (f"{name} K={K}", name, K, v) for K in (4, 8)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))]
DTYPES = ("float32", "bfloat16")
PATH = RESULTS / "lm_table.json"


def optimizer(steps: int) -> optax.GradientTransformation:
    rate = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, max(steps, 6))
    return optax.adamw(rate, b2=0.95, weight_decay=0.1,
                       mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p))


def data(steps: int):
    corpus = pj.data.shakespeare()
    batches = [tuple(jnp.asarray(a) for a in pj.data.windows(corpus.train, M * MB, T, 0, s))
               for s in range(steps)]
    return batches, pj.data.evaluation_windows(corpus.validation, T, EVAL_WINDOWS)


def _pipe(layers, schedule: str, K: int, v: int, dtype: str, remat: str) -> pj.Pipeline:
    return pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((MB, T), jnp.int32),
                       targets=jnp.zeros((MB, T), jnp.int32), stages=K, microbatches=M,
                       schedule=schedule, virtual=v, remat=remat,
                       compute_dtype=None if dtype == "float32" else dtype)


def pipelined(layers, schedule: str, K: int, v: int, dtype: str, steps: int, remat: str):
    """(a step function of (state, batch), its initial state, a function
    state -> the layers' variables)."""
    pipe = _pipe(layers, schedule, K, v, dtype, remat)
    trainer = pipe.trainer(optimizer(steps))
    state = trainer.init(pipe.init(jax.random.key(0)))
    return trainer.step, state, pj.unstage


def plain_loss(layers, dtype: str):
    """The plain jit's loss of one micro-batch, its weights cast to `dtype`."""
    compute = jnp.float32 if dtype == "float32" else jnp.dtype(dtype)

    def loss(v, x, y):
        v = jax.tree.map(lambda a: a.astype(compute), v)
        return pj.losses.next_token(pj.apply_layers(layers, v, x), y)
    return loss


def plain(layers, dtype: str, steps: int):
    """The reference: value_and_grad of the layer list over a scan of the
    micro-batches, AdamW, one jit on one device."""
    opt = optimizer(steps)
    loss = plain_loss(layers, dtype)

    @jax.jit
    def step(state, batch):
        v, s = state
        split = lambda a: a.reshape(M, MB, *a.shape[1:])

        def one(acc, xy):
            value, g = jax.value_and_grad(loss)(v, *xy)
            return jax.tree.map(jnp.add, acc, (value, g)), None
        (value, g), _ = jax.lax.scan(one, (jnp.zeros(()), jax.tree.map(jnp.zeros_like, v)),
                                     tuple(map(split, batch)))
        u, s = opt.update(jax.tree.map(lambda a: a / M, g), s, v)
        return (optax.apply_updates(v, u), s), {"loss": value / M}

    reference = pj.pipeline(layers, loss=pj.losses.next_token,
                            example=jnp.zeros((MB, T), jnp.int32),
                            targets=jnp.zeros((MB, T), jnp.int32), stages=1, microbatches=M)
    variables = pj.unstage(reference.init(jax.random.key(0)))
    return step, (variables, opt.init(variables)), lambda s: s[0]


def build(layers, schedule, K, v, dtype, steps, remat):
    return (plain(layers, dtype, steps) if schedule is None
            else pipelined(layers, schedule, K, v, dtype, steps, remat))


def measure(layers, config, dtype: str, steps: int, remat: str, batches, validation) -> dict:
    name, schedule, K, v = config
    step, state, variables = build(layers, schedule, K, v, dtype, steps, remat)
    start = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - start
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        seconds.append(time.perf_counter() - start)
    loss = pj.loss_evaluator(layers, pj.losses.next_token)(variables(state), *validation)
    median = float(np.median(seconds[3:]))
    return {"config": name, "schedule": schedule or "plain jit", "K": K, "v": v, "dtype": dtype,
            "remat": remat if schedule else "none",
            "validation_loss": round(loss, 6), "train_loss_last": float(metrics["loss"]),
            "step_s": round(median, 4), "tokens_per_s": round(M * MB * T / median, 1),
            "temp_mb_per_device": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 2),
            "gb_accessed": round(cost(compiled).get("bytes accessed", 0) / 1e9, 3),
            "compile_s": round(compile_s, 1), "steps": steps}


def step_bytes(layers, config: tuple, remat: str) -> float:
    """The bytes a step's arithmetic reads and writes over all its devices,
    which share the cores (float32, the update left out): the pipelined
    step's ops as often as its table runs them
    (`pipejax.bench.op_costs.step_count`), the plain jit's
    value_and_grad of one micro-batch M times (XLA's cost analysis of a
    whole step counts a loop's body once: a tick, or a micro-batch)."""
    _, schedule, K, v = config
    if schedule is not None:
        pipe = _pipe(layers, schedule, K, v, "float32", remat)
        return step_count(pipe.schedule, pipe.build.code, "bytes accessed")
    tokens = jnp.zeros((MB, T), jnp.int32)
    variables = pj.layers.initial_variables(layers, tokens, jax.random.key(0))
    compiled = jax.jit(jax.value_and_grad(plain_loss(layers, "float32"))).lower(
        variables, tokens, tokens).compile()
    return M * cost(compiled).get("bytes accessed", 0)


def ratio(layers, a, b, remat: str, rounds: int, batches) -> dict:
    """Step time of config `a` over `b` (float32), alternated `rounds` times;
    the bytes of their arithmetic (`step_bytes`); where both run one
    micro-batch a loop trip (K = 1: a tick, or the plain jit's scan), also
    XLA's bytes accessed of the two compiled steps, which count what the
    interpreter adds around the arithmetic."""
    runs, compiled = {}, {}
    for config in (a, b):
        step, state, _ = build(layers, *config[1:], "float32", len(batches), remat)
        compiled[config[0]] = step.lower(state, batches[0]).compile()
        held = {"state": state}

        def run(c=compiled[config[0]], held=held):
            held["state"], metrics = c(held["state"], batches[0])
            jax.block_until_ready(metrics["loss"])
        runs[config[0]] = run
    times = alternate(runs, rounds)
    accessed = {c[0]: step_bytes(layers, c, remat) for c in (a, b)}
    program = {n: cost(c).get("bytes accessed", 0) for n, c in compiled.items()}
    return {"pair": f"{a[0]} / {b[0]}", "ratio": round(float(np.median(times[a[0]] / times[b[0]])), 3),
            "seconds": {n: round(float(np.median(t)), 4) for n, t in times.items()},
            "bytes_ratio": round(accessed[a[0]] / accessed[b[0]], 4),
            "program_bytes_ratio": (round(program[a[0]] / program[b[0]], 4)
                                    if a[2] == b[2] == 1 else None),
            "rounds": rounds, "remat": remat}


def _label(config: tuple) -> tuple[str, int]:
    name, schedule, K, v = config
    if schedule is None:
        return "plain `jax.jit`", K
    return ("pipelined" if K == 1 else schedule + (f" (v = {v})" if v > 1 else "")), K


def tables() -> dict[str, str]:
    """The language-model page's tables from lm_table.json: each step's
    validation loss (and its difference from the plain jit), tokens/s and
    temp memory in float32 and bfloat16, for `remat="stage"` and `"none"`;
    and the ratios alternated in one process."""
    result = load("lm_table")
    rows = {(r["config"], r["dtype"], r["remat"]): r for r in result["rows"]}
    reference = {r["dtype"]: r["validation_loss"] for r in result["rows"] if r["schedule"] == "plain jit"}
    out = {}
    for remat in ("stage", "none"):
        lines = []
        for config in CONFIGS:
            cells = {}
            for dtype in DTYPES:
                r = rows.get((config[0], dtype, remat if config[1] else "none"))
                if r is None:
                    continue
                gap = r["validation_loss"] - reference[dtype]
                cells |= {f"{dtype}: validation loss (− plain jit)":
                          f"{r['validation_loss']:.6f} ({0 if gap == 0 else signed(gap, '.1e')})",
                          f"{dtype}: tokens/s": f"{r['tokens_per_s']:.0f}",
                          f"{dtype}: temp MB / device": f"{r['temp_mb_per_device']:.1f}"}
            if cells:
                step, K = _label(config)
                lines.append({"step": step, "K": K} | cells)
        out[remat] = markdown(lines)
    out["ratios"] = markdown([{"pair (alternated in one process)": r["pair"], "remat": r["remat"],
                               "time ratio": f"{r['ratio']:.3f}",
                               "bytes ratio": f"{r['bytes_ratio']:.3f}",
                               "compiled steps' bytes ratio":
                                   "—" if r["program_bytes_ratio"] is None
                                   else f"{r['program_bytes_ratio']:.3f}",
                               "rounds": r["rounds"]} for r in result["ratios"]])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--remat", default="stage", choices=["stage", "none"])
    p.add_argument("--only", nargs="*", default=None, help="config names to run (default all)")
    args = p.parse_args()
    old = json.loads(PATH.read_text()) if PATH.exists() else {}
    rows, ratios = old.get("rows", []), old.get("ratios", [])
    done = {(r["config"], r["dtype"], r["remat"]) for r in rows if r["steps"] == args.steps}
    layers = pj.models.gpt(**SIZE)
    batches, validation = data(args.steps)
    for dtype in DTYPES:
        for config in CONFIGS:
            remat = args.remat if config[1] else "none"  # the plain jit keeps its residuals
            if (config[0], dtype, remat) in done or (args.only and config[0] not in args.only):
                continue
            rows.append(measure(layers, config, dtype, args.steps, remat, batches, validation))
            print(json.dumps(rows[-1]), flush=True)
            save("lm_table", {"model": SIZE, "microbatch": MB, "microbatches": M,
                              "rows": rows, "ratios": ratios})
    named = {c[0]: c for c in CONFIGS}
    pairs = [(named["K=1"], named["plain jit"]), (named["1f1b K=8"], named["K=1"])]
    have = {(r["pair"], r["remat"]) for r in ratios}
    for a, b in pairs:
        if (f"{a[0]} / {b[0]}", args.remat) not in have and not args.only:
            ratios.append(ratio(layers, a, b, args.remat, args.rounds, batches))
            print(json.dumps(ratios[-1]), flush=True)
            save("lm_table", {"model": SIZE, "microbatch": MB, "microbatches": M,
                              "rows": rows, "ratios": ratios})
    reference = {r["dtype"]: r["validation_loss"] for r in rows if r["schedule"] == "plain jit"}
    columns = ["config", "dtype", "remat", "validation_loss", "vs_plain", "tokens_per_s",
               "temp_mb_per_device", "gb_accessed", "compile_s"]
    print(table([{k: r.get(k) for k in columns} | {"vs_plain": None if r["dtype"] not in reference
                 else round(r["validation_loss"] - reference[r["dtype"]], 6)} for r in rows]))
    if ratios:
        print(table([{k: r[k] for k in ("pair", "remat", "ratio", "bytes_ratio",
                                        "program_bytes_ratio", "rounds")}
                     for r in ratios]))


if __name__ == "__main__":
    main()
