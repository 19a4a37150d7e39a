"""PipeDream-2BW's one-step delay on a language model: AdamW and Muon against synchronous.

The AdamW study's model, data, optimizers and rates (benchmarks/async_adamw.py:
a byte-level GPT 8 x 64 on Shakespeare, batch 32 windows of 64 bytes as 8
micro-batches of 4, AdamW β 0.9/0.95 with decay 0.1 on matrices, Muon from
optax.contrib with AdamW's update RMS, warm-up then cosine decay) under
`2bw`'s update: one a batch, its gradient computed on the weights one update
behind, W(t + 1) = W(t) + u(∇f(W(t − 1))) at every stage (Narayanan et al.
2021, §3.1), run in `pj.simulate(delays="2bw")`, which equals the 2bw trainer
update for update (tests/compile/test_two_bw.py). The synchronous rows are
the AdamW study's own runs (1F1B, the same batches; read from its JSON at
its tuned rates), so both studies compare with one synchronous run.
Rows, each at the synchronous row's rate of its optimizer:
  AdamW sync, Muon sync   synchronous 1F1B (async_adamw.json)
  AdamW 2bw, Muon 2bw     2BW's one-step delay, no correction
  ... 2bw+ef              with error feedback, λ = 1 (`pj.transforms.error_feedback`)
  ... (own)               the same at a rate of its own: from the synchronous
                          rate (+ef: from the uncorrected row's own rate, as
                          the correction narrows the stable range) along the
                          grid to a rate that beats both neighbours (seed 0)
  AdamW pipedream/pb,     the AdamW study's per-micro-batch asynchronous
  Muon pipedream/pb       tables at K, each optimizer's best correction
                          (error feedback at λ = D among them), at the
                          shared rate or, walked, its own (async_adamw.json)
With `--long F`, Muon sync and Muon's 2BW rows at rates of their own (with
and without error feedback) also run F times the tokens (their schedule over
the longer run), each at a rate walked to at that length from its rate at
1 M (seed 0), to see whether the gap closes with training length.

One JSON row per run (results/async_2bw.json); rows already in the JSON are
skipped, so it runs in parts. The figure, results/async_2bw.png: each row's
validation curve, the mean over its seeds.
Run: python benchmarks/async_2bw.py              (K = 8, 3 seeds, 1 M tokens)
     python benchmarks/async_2bw.py --long 4     (and the 4 M-token Muon rows)
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

import async_adamw as base
import pipejax as pj
from common import RESULTS, save, signed, table

PATH = RESULTS / "async_2bw.json"
TOKENS = 1_048_576  # a run's tokens (the AdamW study's); the longer rows a multiple
SYNCHRONOUS = {"AdamW sync": "AdamW", "Muon sync": "Muon"}
DELAYED = {f"{o} 2bw{c}": o for o in ("AdamW", "Muon") for c in ("", "+ef")}
OWN = {f"{row} (own)": row for row in DELAYED}
ROWS = tuple(f"{o} {r}" for o in ("AdamW", "Muon") for r in (
    "sync", "2bw", "2bw+ef", "2bw (own)", "2bw+ef (own)", "pipedream", "pb"))
LONGER = ("Muon sync", "Muon 2bw (own)", "Muon 2bw+ef (own)")  # the rows `--long` runs


def sync_rate(optimizer: str, tokens: int) -> float | None:
    """The AdamW study's tuned rate of the synchronous row of `optimizer`
    at `tokens` (the study tunes at 1 M)."""
    runs = json.loads(base.PATH.read_text())["runs"] if base.PATH.exists() else []
    return base.best_rate(runs, f"{optimizer} sync", 0, tokens)


def run(row: str, K: int, lr: float, seed: int, tokens: int) -> dict:
    """One 2BW run (the AdamW study's `run`, an update a batch, delay 1)."""
    d = base.data()
    layers, corpus, validation = d["layers"], d["corpus"], d["validation"]
    batches = tokens // (base.M * base.MB * base.T)
    x, y = (np.stack(a) for a in zip(*(pj.data.windows(corpus.train, base.M * base.MB, base.T,
                                                        seed, s) for s in range(batches))))
    opt, _ = base.optimizer(f"{row.split()[0]} sync", base.rate_schedule(lr, batches), batches)
    if "+ef" in row:
        opt = optax.chain(opt, pj.transforms.error_feedback())
    sim = pj.simulate(layers, loss=pj.losses.next_token, optimizer=opt,
                      split=base.split(layers, K), delays="2bw")
    state = sim.init(sim.variables(jax.random.key(seed), jnp.asarray(x[0])))
    evaluate = pj.loss_evaluator(layers, pj.losses.next_token)
    start, curve, chunk = time.perf_counter(), [], batches // base.POINTS
    for p in range(base.POINTS):
        state, _ = sim.run(state, jnp.asarray(x[p * chunk:(p + 1) * chunk]),
                           jnp.asarray(y[p * chunk:(p + 1) * chunk]))
        seen = (p + 1) * chunk * base.M * base.MB * base.T
        curve.append([seen, round(evaluate(sim.params(state), *validation), 5)])
    return {"row": row, "schedule": "2bw", "K": K, "lr": lr, "seed": seed, "tokens": tokens,
            "updates": batches, "delays": sim.delays, "validation_loss": curve[-1][1],
            "curve": curve, "seconds": round(time.perf_counter() - start, 1)}


class Study:
    """The JSON's 2BW runs; `get` runs a missing one and saves it."""

    def __init__(self):
        self.runs = json.loads(PATH.read_text())["runs"] if PATH.exists() else []

    def get(self, row: str, K: int, lr: float, seed: int, tokens: int) -> dict:
        """The run, run now if the JSON lacks it (a row at its own rate reads
        the row at the synchronous rate where the rates meet)."""
        wanted = (row, 0 if row in SYNCHRONOUS else K, lr, seed, tokens)
        same = lambda r: (r["row"], r["K"], r["lr"], r["seed"], r["tokens"]) == wanted or (
            row in OWN and (r["row"], r["K"], r["lr"], r["seed"], r["tokens"])
            == (OWN[row], *wanted[1:]))
        found = next((r for r in self.runs if same(r)), None)
        if found is None:  # a synchronous row runs as the AdamW study runs it
            found = base.train(base.job(row, "pb", K, lr, seed, tokens)) \
                if row in SYNCHRONOUS else run(*wanted)
            self.runs.append(found)
            print(json.dumps({k: v for k, v in found.items() if k != "curve"}), flush=True)
            save("async_2bw", {"model": base.SIZE, "microbatch": base.MB,
                               "microbatches": base.M, "runs": self.runs})
        return found

    def seed_zero(self, row: str, K: int, tokens: int) -> dict[float, float]:
        """A row's seed-0 validation loss by rate at K and `tokens` (an
        own-rate row's with its row's: they share runs)."""
        names, K = (row, OWN[row]) if row in OWN else (row,), 0 if row in SYNCHRONOUS else K
        return {r["lr"]: r["validation_loss"] for r in self.runs if r["seed"] == 0
                and r["row"] in names and (r["K"], r["tokens"]) == (K, tokens)}

    def rate(self, row: str, K: int, tokens: int, run: bool = True) -> float | None:
        """The rate `row` runs at: at `TOKENS` the synchronous rate of its
        optimizer, or for an own-rate row a walk (`async_adamw.walk`, seed
        0) from `start`; at another length a walk at that length from its
        rate at `TOKENS`. With `run` the walks' runs are run, else None while
        a walk lacks them."""
        if tokens == TOKENS and row not in OWN:
            return sync_rate(row.split()[0], TOKENS)
        while True:
            start = self.start(row, K, run) if tokens == TOKENS else \
                self.rate(row, K, TOKENS, run)
            rate, missing = (None, []) if start is None else \
                base.walk(self.seed_zero(row, K, tokens), start)
            if rate is not None or not run:
                return rate
            self.get(row, K, missing[0], 0, tokens)

    def start(self, row: str, K: int, run: bool) -> float | None:
        """Where an own-rate row's walk starts: the synchronous rate, or,
        corrected, the uncorrected row's own rate (the correction narrows
        the stable range: `pj.transforms.error_feedback`)."""
        if "+ef" in row:
            return self.rate(row.replace("+ef", ""), K, TOKENS, run)
        return sync_rate(row.split()[0], TOKENS)


def synchronous_runs(study: Study, row: str, tokens: int) -> list[dict]:
    """A synchronous row's runs at its tuned rate: the AdamW study's, and
    this study's longer ones."""
    runs = json.loads(base.PATH.read_text())["runs"] if base.PATH.exists() else []
    lr = study.rate(row, 0, tokens, run=False)
    return [r for r in runs + study.runs if (r["row"], r["lr"], r["tokens"]) == (row, lr, tokens)]


MUON_ROWS = ("Muon", "Muon stash", "Muon ef")  # the AdamW study's delayed Muon rows


def per_microbatch(K: int, tokens: int) -> dict[str, list[dict]]:
    """The AdamW study's runs of its per-micro-batch asynchronous tables at
    K, by this study's row: per schedule and optimizer, its best row with
    3 seeds (the corrections at the shared rate or, walked, their own),
    each run named by its correction."""
    runs = json.loads(base.PATH.read_text())["runs"] if base.PATH.exists() else []
    rows = base.summary(runs, tokens, [K], base.OWN_ROWS, base.own) + \
        base.summary(runs, tokens, [K], MUON_ROWS)
    adamw = tuple(row for row in base.OWN_ROWS if row not in MUON_ROWS)
    out = {}
    for optimizer, names in (("AdamW", adamw), ("Muon", MUON_ROWS)):
        for schedule in ("pipedream", "pb"):
            found = [r for r in rows if r["row"] in names and r["schedule"] == schedule
                     and r["seeds"] >= 3]
            if found:
                best = min(found, key=lambda r: r["validation_loss"])
                correction = best["row"].removeprefix("Muon").strip() or "none"
                out[f"{optimizer} {schedule}"] = [
                    {**r, "correction": correction} for r in runs
                    if (r["row"], r["schedule"], r["K"], r["lr"], r["tokens"])
                    == (best["row"], schedule, K, best["lr"], tokens)]
    return out


def row_runs(study: Study, row: str, K: int, tokens: int,
             others: dict[str, list[dict]]) -> list[dict]:
    """The runs a row of the table stands for: one a seed, at its rate
    (`others`: the per-micro-batch tables' rows, `per_microbatch`)."""
    if row in SYNCHRONOUS:
        return synchronous_runs(study, row, tokens)
    if row in others:
        return others[row]
    rate = study.rate(row, K, tokens, run=False)
    names = (row, OWN[row]) if row in OWN else (row,)
    return list({r["seed"]: r for r in study.runs if r["row"] in names and
                 (r["K"], r["lr"], r["tokens"]) == (K, rate, tokens)}.values())


def summary(study: Study, K: int, tokens: int) -> list[dict]:
    """Per row: validation loss over seeds (mean, min, max), against the
    synchronous row of its optimizer."""
    rows, means, others = [], {}, per_microbatch(K, tokens)
    for row in ROWS:
        rs = row_runs(study, row, K, tokens, others)
        if not rs:
            continue
        losses = [r["validation_loss"] for r in rs]
        means[row] = mean = float(np.mean(losses))
        sync = means.get(f"{row.split()[0]} sync")
        rows.append({"row": row, "K": K if row not in SYNCHRONOUS else 0, "lr": rs[0]["lr"],
                     "tokens": tokens, "seeds": len(rs), "validation_loss": round(mean, 4),
                     "min": min(losses), "max": max(losses),
                     "vs_sync_%": None if sync is None else round(100 * (mean / sync - 1), 2),
                     "correction": rs[0].get("correction", "ef" if "+ef" in row else None)})
    return rows


def label(row: str, correction: str | None) -> str:
    """A row's name, with the correction of a per-micro-batch table's row."""
    return row if correction is None or "+ef" in row else f"{row} ({correction})"


def markdown(rows: list[dict]) -> str:
    """The staleness page's table."""
    lines = ["| row | tokens | rate | seeds | validation loss | against its synchronous row |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        vs = "" if r["vs_sync_%"] is None or r["row"] in SYNCHRONOUS else \
            f"{signed(r['vs_sync_%'], '.2f')} %"
        lines.append(f"| {label(r['row'], r['correction'])} | {r['tokens'] / 1e6:.0f} M | "
                     f"{r['lr']:.0e} | {r['seeds']} | "
                     f"{r['validation_loss']:.4f} ± {(r['max'] - r['min']) / 2:.4f} | {vs} |")
    return "\n".join(lines)


def tables(K: int = 8) -> dict[str, str]:
    """The staleness page's table and account of the gap, and the README's
    line, from the JSON."""
    study = Study()
    longer = sorted({r["tokens"] for r in study.runs} - {TOKENS})
    rows = summary(study, K, TOKENS) + [r for t in longer for r in summary(study, K, t)
                                          if r["row"].startswith("Muon")]
    return {"table": markdown(rows) if rows else "Not measured yet.",
            "headline": headline(rows), "cause": cause(study, rows, K)}


def cause(study: Study, rows: list[dict], K: int) -> str:
    """Per optimizer and length, the gap of 2BW at a rate of its own to the
    synchronous row, split into the rate the delay forbids (synchronous
    training at the 2BW row's rate against its own) and the delay at that
    rate, without and with error feedback where both ran, from the seed-0
    runs (the synchronous grid at 1 M is the AdamW study's, at a longer
    length this study's walk)."""
    runs = json.loads(base.PATH.read_text())["runs"] if base.PATH.exists() else []
    rates = {(r["row"], r["tokens"]): r["lr"] for r in rows}
    sync = lambda o, lr, tokens: next((r["validation_loss"] for r in runs + study.runs if (
        r["row"], r["lr"], r["seed"], r["tokens"]) == (f"{o} sync", lr, 0, tokens)), None)
    out = []
    for tokens in sorted({t for _, t in rates}):
        for o in ("AdamW", "Muon"):
            synchronous, own = f"{o} sync", [f"{o} 2bw (own)", f"{o} 2bw+ef (own)"]
            present = [row for row in own if (row, tokens) in rates]
            if (synchronous, tokens) not in rates or not present:
                continue
            best, parts = sync(o, rates[synchronous, tokens], tokens), []
            for row in present:
                lr = rates[row, tokens]
                slow, delayed = sync(o, lr, tokens), study.seed_zero(row, K, tokens).get(lr)
                if None in (best, slow, delayed):
                    break
                said = "with error feedback" if "+ef" in row else "2BW"
                parts.append(f"{said} at {lr:.0e} {delayed - best:.3f} above it, "
                             f"{slow - best:.3f} the rate (synchronous {o} at {lr:.0e}: "
                             f"{slow:.3f}) and {delayed - slow:.3f} the delay")
            else:
                out.append(f"{o} at {tokens / 1e6:.0f} M tokens, synchronous at "
                           f"{rates[synchronous, tokens]:.0e} {best:.3f}: " + "; ".join(parts))
    return ". ".join(out) + " (seed 0)." if out else "Not measured yet."


def headline(rows: list[dict]) -> str:
    """The README's sentence: 2BW's gap to synchronous training per
    optimizer, with and without error feedback, at the synchronous rates and
    at rates of their own (and at more tokens, where run), with the regime
    it was measured in."""
    at = {(r["row"], r["tokens"]): r for r in rows}
    gap = lambda row, t=TOKENS: signed(at[row, t]["vs_sync_%"], ".1f") + " %"
    if not all((row, TOKENS) in at for row in (*DELAYED, *OWN)):
        return "not measured yet."
    each = [f"{o} {gap(f'{o} 2bw')} at the synchronous rate ({gap(f'{o} 2bw+ef')} with error "
            f"feedback), {gap(f'{o} 2bw (own)')} at a rate of its own "
            f"({gap(f'{o} 2bw+ef (own)')})" for o in ("AdamW", "Muon")]
    longer = sorted({t for _, t in at} - {TOKENS})
    gaps = {t: [f"{gap(row, t)}{' with error feedback' * ('+ef' in row)}" for row in OWN
                if row.startswith("Muon") and (row, t) in at] for t in longer}
    tail = "".join(f"; at {t / 1e6:.0f} M tokens, rates walked at that length, Muon "
                   + ", ".join(said) for t, said in gaps.items() if said)
    return (f"PipeDream-2BW's one-step delay on the 8 × 64 byte GPT at K = 8, 1 M tokens in "
            f"batches of 2048 (far below Zmushko et al.'s models of up to 10 B parameters "
            f"and 200 B tokens), against the synchronous runs: {'; '.join(each)}{tail}.")


def plot(study: Study, K: int, path) -> None:
    """Validation loss against tokens, the mean over a row's seeds: AdamW's
    rows, Muon's, and Muon's at each longer length (synchronous dashed,
    error feedback dotted, a rate of its own thicker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longer = sorted({r["tokens"] for r in study.runs} - {TOKENS})
    panels = [("AdamW", TOKENS), ("Muon", TOKENS)] + [("Muon", t) for t in longer]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.4), sharey=True)
    colors = dict(zip(("sync", "2bw", "pipedream", "pb"), plt.cm.tab10.colors))
    for ax, (optimizer, tokens) in zip(axes, panels):
        others = per_microbatch(K, tokens)
        for row in (r for r in ROWS if r.startswith(optimizer)):
            rs = row_runs(study, row, K, tokens, others)
            if not rs:
                continue
            mean = np.mean([r["curve"] for r in rs], 0)
            style = "--" if row in SYNCHRONOUS else ":" if "+ef" in row else "-"
            name = label(row, rs[0].get("correction")).removeprefix(optimizer + " ")
            ax.plot(mean[:, 0] / 1e6, mean[:, 1], style, linewidth=2.2 if row in OWN else 1.2,
                    color=colors[row.split()[1].removesuffix("+ef")],
                    label=f"{name} {rs[0]['lr']:.0e} ({len(rs)})")
        ax.set(title=f"{optimizer}, {tokens / 1e6:.0f} M tokens", xlabel="tokens (millions)")
        ax.legend(fontsize=7)
    axes[0].set(ylabel="validation loss (nats per byte)", ylim=(1.5, 3.4))
    fig.suptitle(f"GPT {base.SIZE['depth']}x{base.SIZE['width']}, Shakespeare, K = {K}: "
                 "one-step delay (2bw) against synchronous (rate, seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--K", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--long", type=int, default=0,
                   help="F: Muon sync and Muon's 2BW rows at rates of their own also at F "
                        "times the tokens, each at a rate walked to at that length")
    p.add_argument("--rows", nargs="*", default=list(DELAYED) + list(OWN))
    args = p.parse_args()
    study = Study()
    for row in args.rows:
        for seed in args.seeds:
            study.get(row, args.K, study.rate(row, args.K, TOKENS), seed, TOKENS)
    tokens = args.long * TOKENS
    for row in LONGER if args.long else ():
        for seed in args.seeds:
            study.get(row, args.K, study.rate(row, args.K, tokens), seed, tokens)
    for row in LONGER[1:] if args.long else ():  # `cause`: synchronous at the 2BW row's rate
        study.get(LONGER[0], args.K, study.rate(row, args.K, tokens), 0, tokens)
    rows = summary(study, args.K, TOKENS)
    if args.long:
        rows += [r for r in summary(study, args.K, tokens) if r["row"].startswith("Muon")]
    print(table(rows))
    print(markdown(rows))
    plot(study, args.K, RESULTS / "async_2bw.png")


if __name__ == "__main__":
    main()
