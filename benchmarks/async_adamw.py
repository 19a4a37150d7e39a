"""Asynchronous pipelines with AdamW on a language model: every correction on one table.

A byte-level GPT (`pj.models.gpt(depth=8, width=64, heads=4, context=64)`,
10 layers, split into K stages as `pj.pipeline` partitions it) trains on
Shakespeare's works (`pj.data.shakespeare`) in `pj.simulate`, which equals
the PB and PipeDream trainers update for update (tests/test_delayed.py).
Every run of a seed sees the same windows in the same order: batch s is
`pj.data.windows(train, 32, 64, seed, s)`. The synchronous rows (1F1B: the
mean gradient of M = 8 micro-batches, one update a batch, as the pipelined
step computes it) take each batch whole; the asynchronous rows take its 8
micro-batches of 4 windows one update each, every stage's gradient delayed
as the table delays it (PB 2(K−1−k), PipeDream K−1−k updates).

AdamW: β1 0.9, β2 0.95, weight decay 0.1 on matrices, linear warm-up over 5 %
of the updates then cosine decay to 0. Rows:
  AdamW sync     synchronous 1F1B, batch 32
  AdamW no delay update size 4 without a delay (what the update size costs)
  none           AdamW on the delayed gradients
  stash          PipeDream's weight stashing
  lwp+sc         LWP_D (difference form) with SC_D on Adam's first moment
  pipemare       the rate divided by D^p, p fading over the first 20 % of updates
  pipeoptim      the forward at w − η·D·m̂/(√v̂ + ε) (Guan et al. 2023)
  nesterov       NAdam with β1 0.99 on stashed weights (Ajanthan et al. 2025)
  ef             error feedback at λ = D, the stage's delay (`pj.transforms.ef`)
  NAdam no delay nesterov's optimizer at update size 4 without a delay
  Muon sync      optax.contrib.muon, synchronous; Muon on the blocks' matrices,
                 Adam (β2 0.95) on the embeddings, the head and the vectors;
                 its updates' RMS matched to AdamW's (consistent_rms=0.2, Liu
                 et al. 2025), so that it takes AdamW's decay
  Muon no delay  the same at update size 4 without a delay
  Muon           the same on the delayed gradients, no correction
  Muon stash     with PipeDream's weight stashing
  Muon ef        with error feedback at λ = D (the corrections that run on Muon:
                 `pipejax.transforms.muon.ON_MUON`)
  ... (√)        the row with the synchronous row's AdamW moved to update size 4
                 by the square-root rule (`scale_adam_hyperparams`, Malladi et al.
                 2022: η/√8, 1 − β by 1/8, ε·√8, decay λ/√8), no rate tuned
The rates, an optimizer at a time: the synchronous rows' and those of every
asynchronous row of a K are the best of the grid `RATES` at seed 0, for
"AdamW sync" and for "none" with PB at that K (for Muon: "Muon sync" and
"Muon" with PB; `--tune`). With `--own` the delayed AdamW rows (and Muon ef,
whose correction narrows the stable range) also run at a
rate of their own: from the shared one, along the grid to the rate that beats
both its neighbours (PB, seed 0). The effective delay is η·D at the first stage
(Adam's steps are normalized: a gradient moves each weight by about η over
time, so D updates of delay are η·D of distance).

One JSON row per run (validation loss on 256 windows at 8 points); rows
already in the JSON are skipped, so the study runs in parts.
Run: python benchmarks/async_adamw.py            (every row, K = 4 and 8, 3 seeds)
     python benchmarks/async_adamw.py --tune --K 8
     python benchmarks/async_adamw.py --K 8 --schedules pb --rows none lwp+sc --seeds 0 1 2
     python benchmarks/async_adamw.py --K 8 --rows nesterov --own
     python benchmarks/async_adamw.py --K 8 --rows ef "Muon stash" "Muon ef" --own
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
from common import RESULTS, save, signed, table

SIZE = dict(depth=8, width=64, heads=4, context=64)
T, MB, M = SIZE["context"], 4, 8
EVAL_WINDOWS, POINTS = 256, 8
RATES = (3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
GRID = 6  # the grid is RATES[:GRID], extended upwards while its best is its largest rate
SYNCHRONOUS = ("AdamW sync", "Muon sync")
SCALED = " (√)"  # the square-root rule's rows
ROWS = ("AdamW sync", "AdamW no delay", "none", "stash", "lwp+sc", "pipemare", "pipeoptim",
        "nesterov", "ef", "NAdam no delay", "Muon sync", "Muon no delay", "Muon", "Muon stash",
        "Muon ef",
        *(row + SCALED for row in ("AdamW no delay", "none", "stash", "lwp+sc", "pipeoptim")))
OWN_ROWS = ("none", "stash", "lwp+sc", "pipemare", "pipeoptim", "nesterov", "ef",  # AdamW's
            "Muon ef")  # the rows `--own` may walk
PATH = RESULTS / "async_adamw.json"


def matrices(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


ADAMW = pj.transforms.AdamW(b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices)
SQRT_RATE, SQRT_ADAMW = pj.transforms.scale_adam_hyperparams(1.0, ADAMW, M * MB, MB)


def undelayed(row: str) -> bool:
    return row in SYNCHRONOUS or "no delay" in row


def rate_schedule(peak: float, updates: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, peak, max(updates // 20, 1), updates)


MUON = pj.transforms.Muon(beta=0.95, weight_decay=0.1, mask=matrices,
                          dimensions=pj.models.gpt_muon_dimensions)


def optimizer(row: str, rate: optax.Schedule, updates: int) -> tuple:
    """(an optimizer for `pj.simulate`, whether the backward uses the stashed weights)."""
    adam = SQRT_ADAMW if row.endswith(SCALED) else ADAMW
    row = row.removesuffix(SCALED)
    row = "nesterov" if row == "NAdam no delay" else row  # no delay: nothing is stashed
    if row in ("Muon stash", "Muon ef"):
        mit = pj.transforms.mitigation(row.split()[1], rate, optimizer=MUON)
        return mit.optimizer, mit.weight_stashing
    if row.startswith("Muon"):
        return MUON(rate), False
    if row in ("AdamW sync", "AdamW no delay"):
        return adam(rate), False
    settings = {"pipemare": {"warmup_steps": max(updates // 5, 1)},
                "nesterov": {"optimizer": ADAMW._replace(b1=0.99)}}.get(row, {})
    mit = pj.transforms.mitigation(row, rate, **{"optimizer": adam, **settings})
    return mit.optimizer, mit.weight_stashing


def split(layers, K: int) -> tuple[int, ...]:
    """Layer counts per stage as `pj.pipeline` partitions the model at K stages."""
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((MB, T), jnp.int32),
                       targets=jnp.zeros((MB, T), jnp.int32), stages=K, microbatches=M)
    return pipe.plan.split


def run(layers, corpus, validation, row: str, schedule: str, K: int, lr: float, seed: int,
        tokens: int) -> dict:
    """One training run: its validation curve against tokens."""
    sync = row in SYNCHRONOUS
    batches = tokens // (M * MB * T)
    x, y = (np.stack(a) for a in zip(*(pj.data.windows(corpus.train, M * MB, T, seed, s)
                                        for s in range(batches))))
    if not sync:  # the micro-batches of each batch in order, one update each
        x, y = x.reshape(-1, MB, T), y.reshape(-1, MB, T)
    updates = len(x)
    opt, stash = optimizer(row, rate_schedule(lr, updates), updates)
    delays = 0 if undelayed(row) else schedule
    sim = pj.simulate(layers, loss=pj.losses.next_token, optimizer=opt,
                      split=split(layers, K) if delays else 1, delays=delays, consistent=stash)
    state = sim.init(sim.variables(jax.random.key(seed), jnp.asarray(x[0])))
    evaluate = pj.loss_evaluator(layers, pj.losses.next_token)
    start, curve, chunk = time.perf_counter(), [], updates // POINTS
    for p in range(POINTS):
        state, _ = sim.run(state, jnp.asarray(x[p * chunk:(p + 1) * chunk]),
                           jnp.asarray(y[p * chunk:(p + 1) * chunk]))
        seen = (p + 1) * chunk * (MB if not sync else M * MB) * T
        curve.append([seen, round(evaluate(sim.params(state), *validation), 5)])
    return {"row": row, "schedule": "1f1b" if sync else (schedule if delays else "-"), "K": K,
            "lr": lr, "seed": seed, "tokens": tokens, "updates": updates,
            "delays": sim.delays, "effective_delay": round(lr * sim.delays[0], 5),
            "validation_loss": curve[-1][1], "curve": curve,
            "seconds": round(time.perf_counter() - start, 1)}


def key(r: dict) -> tuple:
    return r["row"], r["schedule"], r["K"], r["lr"], r["seed"], r["tokens"]


def job(row: str, schedule: str, K: int, lr: float, seed: int, tokens: int) -> tuple:
    """A run's key as the JSON stores it: an undelayed row has K 0 and no schedule."""
    sync = row in SYNCHRONOUS
    return (row, "1f1b" if sync else ("-" if undelayed(row) else schedule),
            0 if undelayed(row) else K, lr, seed, tokens)


_STUDY: dict = {}


def data() -> dict:
    """The model, the corpus and the validation windows, built once."""
    if not _STUDY:
        corpus = pj.data.shakespeare()
        _STUDY.update(layers=pj.models.gpt(**SIZE), corpus=corpus, validation=tuple(
            jnp.asarray(a) for a in pj.data.evaluation_windows(corpus.validation, T,
                                                               EVAL_WINDOWS)))
    return _STUDY


def train(wanted: tuple) -> dict:
    """One run: the model and the data built once."""
    row, schedule, K, lr, seed, tokens = wanted
    d = data()
    r = run(d["layers"], d["corpus"], d["validation"], row, schedule, K or 1, lr, seed, tokens)
    return {**r, "K": K}


class Study:
    """The JSON's runs, and the runs still to do (`finish` runs them)."""

    def __init__(self, tokens: int):
        old = json.loads(PATH.read_text()) if PATH.exists() else {}
        self.runs, self.tokens = old.get("runs", []), tokens
        self.pending: list[tuple] = []

    def get(self, row: str, schedule: str, K: int, lr: float, seed: int) -> dict | None:
        """The run if the JSON has it, else None and the run is pending."""
        wanted = job(row, schedule, K, lr, seed, self.tokens)
        found = next((r for r in self.runs if key(r) == wanted), None)
        if found is None and wanted not in self.pending:
            self.pending.append(wanted)
        return found

    def finish(self) -> None:
        """Run the pending runs, saving each as it ends (XLA's CPU kernels use
        both cores: two runs at a time on one thread each took twice as long)."""
        if not self.pending:
            raise RuntimeError("a rate is still unknown but no run is pending")
        jobs, self.pending = self.pending, []
        for j in jobs:
            self.add(train(j))

    def add(self, r: dict) -> None:
        self.runs.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
        save("async_adamw", {"model": SIZE, "microbatch": MB, "microbatches": M, "rates": RATES,
                             "runs": self.runs})

    def tuned(self, row: str, K: int) -> float | None:
        """The rate of `row` at K (`best_rate`), the runs its grid needs pending."""
        rate, missing = tuning(self.runs, row, K, self.tokens)
        base, schedule = tuning_row(row)
        for lr in missing:
            self.get(base, schedule, K, lr, 0)
        return rate

    def own(self, row: str, K: int) -> float | None:
        """The rate of `row`'s own (`own_rate`), the runs its search needs pending."""
        rate, missing = own_rate(self.runs, row, K, self.tokens)
        for lr in missing:
            self.get(row, "pb", K, lr, 0)
        return rate


def tuning_row(row: str) -> tuple[str, str]:
    """The row (and schedule) whose grid gives `row` its rate: the
    synchronous row of its optimizer for synchronous and (√) rows, else that
    optimizer on PB without a correction."""
    muon = row.startswith("Muon")
    if row in SYNCHRONOUS or row.endswith(SCALED):
        return ("Muon sync" if muon else "AdamW sync"), "1f1b"
    return ("Muon" if muon else "none"), "pb"


def seed_zero(runs: list, row: str, schedule: str, K: int, tokens: int) -> dict[float, float]:
    """Validation loss by rate of `row`'s seed-0 runs on `schedule` at K."""
    return {r["lr"]: r["validation_loss"] for r in runs if r["tokens"] == tokens
            and r["seed"] == 0 and (r["row"], r["schedule"], r["K"]) == (row, schedule, K)}


def tuning(runs: list, row: str, K: int, tokens: int) -> tuple[float | None, list[float]]:
    """`row`'s rate at K and the rates of its grid still to run: the best of
    the grid at seed 0 for its `tuning_row`, the same for every row of an
    optimizer and K; the grid `RATES[:GRID]` grows by the next rate of
    `RATES` while its best is its largest. The (√) rows take the synchronous
    AdamW rate moved by the square-root rule."""
    base, schedule = tuning_row(row)
    if row.endswith(SCALED):
        best, missing = tuning(runs, base, K, tokens)
        return (None if best is None else best * SQRT_RATE), missing
    losses = seed_zero(runs, base, schedule, 0 if schedule == "1f1b" else K, tokens)
    missing = [lr for lr in RATES[:GRID] if lr not in losses]
    if missing:
        return None, missing
    n = GRID
    while n < len(RATES) and RATES[n] in losses:
        n += 1
    best = min(RATES[:n], key=losses.get)
    return (None, [RATES[n]]) if best == RATES[n - 1] and n < len(RATES) else (best, [])


def best_rate(runs: list, row: str, K: int, tokens: int) -> float | None:
    """`row`'s tuned rate at K (`tuning`), None while its grid needs runs."""
    return tuning(runs, row, K, tokens)[0]


def own_rate(runs: list, row: str, K: int, tokens: int) -> tuple[float | None, list[float]]:
    """`row`'s own rate at K: from its optimizer's tuned rate, a `walk` (PB,
    seed 0); (None, the rates still to run) while the walk needs runs."""
    start = best_rate(runs, row, K, tokens)
    if start is None:
        return None, []
    return walk(seed_zero(runs, row, "pb", K, tokens), start)


def walk(losses: dict[float, float], start: float) -> tuple[float | None, list[float]]:
    """A rate of its own: from `start` along `RATES` to a better neighbour
    while there is one (taken before the other is run), ending at a rate
    that beats both; (the rate, []) once `losses` (by rate) hold the walk,
    else (None, the rates to run next)."""
    i = RATES.index(start)
    while True:
        if RATES[i] not in losses:
            return None, [RATES[i]]
        near = [RATES[j] for j in (i - 1, i + 1) if 0 <= j < len(RATES)]
        better = [lr for lr in near if lr in losses and losses[lr] < losses[RATES[i]]]
        if better:
            i = RATES.index(min(better, key=losses.get))
            continue
        missing = [lr for lr in near if lr not in losses]
        return (None, missing) if missing else (RATES[i], [])


def own(runs: list, row: str, K: int, tokens: int) -> float | None:
    """`row`'s own rate at K (`own_rate`), None while its walk needs runs."""
    return own_rate(runs, row, K, tokens)[0]


def summary(runs: list, tokens: int, Ks: list[int], rows: tuple = ROWS,
            rate=best_rate) -> list[dict]:
    """Per K and row, at the rate `rate(runs, row, K, tokens)` gives:
    validation loss over seeds (mean, min, max) and against synchronous
    AdamW's mean at its tuned rate."""
    sync = [r["validation_loss"] for r in runs if (r["row"], r["lr"], r["tokens"]) ==
            ("AdamW sync", best_rate(runs, "AdamW sync", 0, tokens), tokens)]
    sync_loss = float(np.mean(sync)) if sync else None
    out = []
    for K in Ks:
        for row in rows:
            lr = rate(runs, row, K, tokens)
            for schedule in ("1f1b", "-", "pb", "pipedream"):
                rs = [r for r in runs if (r["row"], r["schedule"], r["lr"], r["tokens"]) ==
                      (row, schedule, lr, tokens) and r["K"] in (0, K)]
                if not rs:
                    continue
                losses = [r["validation_loss"] for r in rs]
                mean = float(np.mean(losses))
                out.append({"K": K, "row": row, "schedule": schedule, "lr": lr,
                            "seeds": len(rs), "validation_loss": round(mean, 4),
                            "min": min(losses), "max": max(losses),
                            "vs_sync_%": None if sync_loss is None else
                            round(100 * (mean / sync_loss - 1), 2),
                            "effective_delay": rs[0]["effective_delay"]})
    return out


def markdown(summary: list[dict], Ks: list[int], rates: bool = False) -> str:
    """The summary as the reproductions page's table: a column per K and schedule, a cell
    "mean ± half the seeds' range (against AdamW sync)" (and the rate, with
    `rates`); an undelayed row fills both columns of its K."""
    columns = [(K, s) for K in sorted(Ks, reverse=True) for s in ("pb", "pipedream")]
    cells: dict[tuple, str] = {}
    for r in summary:
        cell = (f"{r['validation_loss']:.3f} ± {(r['max'] - r['min']) / 2:.3f} "
                f"({r['vs_sync_%']:+.1f} %)" + (f", η {r['lr']:.0e}" if rates else ""))
        for s in (("pb", "pipedream") if r["schedule"] in ("1f1b", "-") else (r["schedule"],)):
            cells[r["row"], r["K"], s] = cell
    head = ["row", *(f"K = {K}, {'PB' if s == 'pb' else 'PipeDream'}" for K, s in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in [row for row in ROWS if any(r["row"] == row for r in summary)]:
        row_cells = [cells.get((row, *c), "") for c in columns]
        lines.append("| " + " | ".join([row, *row_cells]) + " |")
    return "\n".join(lines)


def tables(tokens: int = 1_048_576, Ks: tuple = (4, 8)) -> dict[str, str]:
    """The reproductions page's tables from the JSON (the docs' build reads
    them): every row at the shared rates, and the rows walked to rates of
    their own (at a K or more)."""
    runs = Study(tokens).runs
    walked = tuple(row for row in OWN_ROWS if any(own(runs, row, K, tokens) for K in Ks))
    return {"shared": markdown(summary(runs, tokens, list(Ks)), list(Ks)),
            "own": markdown(summary(runs, tokens, list(Ks), walked, own), list(Ks), True),
            "headline": headline(summary(runs, tokens, [max(Ks)]), max(Ks))}


ADAM_ERA = {"pipeoptim": "PipeOptim's forecast", "nesterov": "a delay-aware Nesterov"}


def headline(rows: list[dict], K: int) -> str:
    """The README's sentence: synchronous AdamW, PB with AdamW, its best
    Adam-era correction and asynchronous Muon at K, at the shared rates."""
    pb = {r["row"]: r for r in rows if r["schedule"] == "pb"}
    sync = next(r for r in rows if r["row"] == "AdamW sync")
    best = min(ADAM_ERA, key=lambda row: pb[row]["validation_loss"])
    said = lambda r: f"{r['validation_loss']:.3f} ({signed(r['vs_sync_%'], '.1f')} %)"
    return (f"a byte-level GPT on Shakespeare at K = {K}, equal tokens: synchronous AdamW "
            f"{sync['validation_loss']:.3f} validation loss; PB with AdamW {said(pb['none'])}, "
            f"with the best Adam-era correction ({ADAM_ERA[best]}) {said(pb[best])}; "
            f"asynchronous Muon {said(pb['Muon'])}.")


def plot(runs: list, tokens: int, K: int, path) -> None:
    """Validation loss against tokens at K, PB: one line a row (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.4, 4.6))
    colors = plt.cm.tab20(np.linspace(0, 1, 20))
    for i, row in enumerate(ROWS):
        lr = best_rate(runs, row, K, tokens)
        curves = [r["curve"] for r in runs if r["row"] == row and r["lr"] == lr
                  and r["tokens"] == tokens and r["schedule"] in ("1f1b", "-", "pb")
                  and r["K"] in (0, K)]
        if curves:
            mean = np.mean(curves, 0)
            ax.plot(mean[:, 0] / 1e6, mean[:, 1], label=f"{row} ({len(curves)} seeds)",
                    color=colors[i % 20], linestyle="--" if undelayed(row) else "-")
    ax.set(title=f"GPT {SIZE['depth']}x{SIZE['width']}, Shakespeare, PB at K = {K}",
           xlabel="tokens (millions)", ylabel="validation loss (nats per byte)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.0))
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1_048_576, help="training tokens per run")
    p.add_argument("--K", type=int, nargs="*", default=[4, 8])
    p.add_argument("--schedules", nargs="*", default=["pb", "pipedream"])
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--tune", action="store_true", help="only the learning-rate grids")
    p.add_argument("--own", action="store_true",
                   help="the delayed AdamW rows at rates of their own (`own_rate`) too")
    p.add_argument("--rates", type=float, nargs="*",
                   help="run the rows at these rates instead of the tuned one (kept out of the "
                        "table, printed after it)")
    args = p.parse_args()
    study = Study(args.tokens)
    grids = dict.fromkeys(tuning_row(row)[0] for row in args.rows)  # rows tuned on their own grid
    while not args.rates and None in [study.tuned(row, K) for K in args.K for row in grids]:
        study.finish()  # the grids first: every rate below comes from them
    for K in args.K if not args.tune else []:
        for row in args.rows:
            for lr in args.rates or [study.tuned(row, K)]:
                for schedule in ["pb"] if undelayed(row) else args.schedules:
                    for seed in args.seeds:
                        study.get(row, schedule, K, lr, seed)
    if study.pending:
        study.finish()
    own_rows = [row for row in args.rows if row in OWN_ROWS] if args.own else []
    while None in [study.own(row, K) for K in args.K for row in own_rows]:
        study.finish()  # one step of every row's walk along the grid
    for K in args.K if not args.tune else []:
        for row in own_rows:
            for schedule in args.schedules:
                for seed in args.seeds:
                    study.get(row, schedule, K, study.own(row, K), seed)
    if study.pending:
        study.finish()
    rows = summary(study.runs, args.tokens, args.K)
    print(table(rows))
    print(markdown(rows, args.K))
    if own_rows:
        print(markdown(summary(study.runs, args.tokens, args.K, OWN_ROWS, own), args.K, True))
    for r in study.runs if args.rates else []:
        if r["lr"] in args.rates and r["row"] in args.rows and r["K"] in (0, *args.K):
            print(r["row"], r["schedule"], r["K"], "lr", r["lr"], "seed", r["seed"],
                  r["validation_loss"])
    if any(r["K"] == 8 for r in study.runs):
        plot(study.runs, args.tokens, 8, RESULTS / "async_adamw.png")


if __name__ == "__main__":
    main()
