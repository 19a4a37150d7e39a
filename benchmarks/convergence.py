"""Convergence of pipelined backpropagation with each staleness mitigation, in
the papers' regime (Kosson et al. 2020, Table 1, Fig. 13), on MNIST-1D.

The regime (Kosson et al. §3.1, §4): update size 1 (one update per
micro-batch of one example), the hyper-parameters of a reference recipe
(He et al. 2016: learning rate 0.1, momentum 0.9, batch 128) scaled by eq. 9
to that update size, the learning rate ×0.1 at 50 % and 75 % of training,
the default LWP_D and SC_D untuned, LWP in the velocity form (H.5).
Rows: SGDM without delay (what a synchronous pipeline computes at the same
update size), PB, PB + weight stashing, PB + SpecTrain, PB + SC_D,
PB + LWP_D, PB + LWP_D + SC_D; final test accuracy, mean ± std over seeds,
from `pj.simulate`. Models and splits: the fine GroupNorm ResNet (one layer
per convolution and per residual sum, as Kosson et al. pipeline it; depth
6, width 16, the model of the issue's independent check) at K = 8, 16 and
one layer per stage (21), and a GroupNorm VGG at K = 8. Also: the momentum
sweep of Fig. 13 (each sample's contribution η/(1 − m)/B fixed, m varied;
one seed; eq. 9's momentum is the main table's seed 0 at K = 8), the old
regime (micro-batch 8, m = 0.9) with the distance the weights move during
the delay, η/(1 − m)·D, and one row per model rerun through the real
`pipe.trainer` on simulated devices next to its `pj.simulate` row.

Every SGDM mitigation is built with `mitigation(..., sweep=True)`: one
chain whose numbers live in the optimizer state, equal to the named chain
(tested), so that the rows of a (model, K) share one compiled program
through JAX's persistent cache. Runs go to a pool of worker processes, one
per core.

Run: python benchmarks/convergence.py [--quick] [--workers 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools
import json
import time
from typing import NamedTuple

import numpy as np

from common import RESULTS, in_words, in_workers, load, markdown, save, table

REFERENCE = (0.1, 0.9, 128)  # He et al. 2016's CIFAR recipe, as Kosson et al. scale it
EPOCHS, DECAY_AT = 12, (0.5, 0.75)
SEEDS = 3
TRAINER_M = 32  # micro-batches per trainer step (a step of M trains as M/m steps of m, tested)
GAP = "PB's gap (points)"  # the summary column of synchronous SGDM minus PB, in points
MITIGATIONS = [("SGDM, no delay", "none", 0), ("PB", "none", "pb"),
               ("PB + stash", "stash", "pb"), ("PB + SpecTrain", "spectrain", "pb"),
               ("PB + SC_D", "sc", "pb"), ("PB + LWP_D", "lwp", "pb"),
               ("PB + LWP_D + SC_D", "lwp+sc", "pb")]
SPLITS = {"resnet": (8, 16, "finest"), "vgg": (8,)}
SWEEP_MOMENTA = (0.0, 0.9, 0.99)  # and eq. 9's m^(1/128) = 0.99918: the main table's runs
SWEEP_ROWS = [MITIGATIONS[0], MITIGATIONS[1], MITIGATIONS[-1]]


MODELS = {"resnet": "fine GroupNorm ResNet: depth 6, width 16, 21 layers",
          "vgg": "GroupNorm VGG: 8, M, 16, M, 32, 32, M, 64, 64, M, dense 64; 15 layers"}


def build(model: str) -> list:
    import pipejax as pj

    if model == "resnet":
        return pj.models.resnet(depth=6, width=16, groups=4, fine=True)
    return pj.models.vgg((8, "M", 16, "M", 32, 32, "M", 64, 64, "M"), groups=4, dense=64)


class Run(NamedTuple):
    """One configuration, trained for each seed."""

    table: str  # "main" | "sweep" | "old" | "trainer"
    model: str
    split: int | str  # K, or "finest": one layer per stage
    row: str
    mitigation: str
    delays: int | str
    micro_batch: int
    hyper: tuple  # ("eq9",) | ("contribution", m) | ("fixed", lr, m)
    schedule: str  # "step" | "constant"
    epochs: int
    seeds: tuple[int, ...]

    def rate_and_momentum(self, updates: int):
        """(η schedule, m) of this run and its peak η."""
        import pipejax as pj

        T, (lr, m, batch) = pj.transforms, REFERENCE
        kind = self.hyper[0]
        if kind == "fixed":
            lr, m = self.hyper[1:]
            return T.lr_schedule(self.schedule, lr, updates, decay_at=DECAY_AT), m, lr
        if kind == "eq9":  # Kosson et al. eq. 9: m′ = m^(B′/B), η′ = η(B′/B)(1 − m′)/(1 − m)
            schedule = T.lr_schedule(self.schedule, lr, updates, decay_at=DECAY_AT)
            rate, m2 = T.scale_hyperparams(schedule, m, batch, self.micro_batch)
            return rate, m2, T.scale_hyperparams(lr, m, batch, self.micro_batch)[0]
        # appendix F: m′ chosen, η′ from eq. 9's second expression (each sample's
        # total contribution η/(1 − m)/B stays the reference's)
        m2 = self.hyper[1]
        peak = lr * self.micro_batch / batch * (1 - m2) / (1 - m)
        return T.lr_schedule(self.schedule, peak, updates, decay_at=DECAY_AT), m2, peak

    @property
    def cost(self) -> float:
        """Relative seconds, to start the longest runs first."""
        per_update = {"resnet": 1.0, "vgg": 0.5}[self.model] * self.micro_batch ** 0.6
        return per_update * len(self.seeds) * self.epochs / self.micro_batch


def updates_per_epoch(examples: int, mb: int) -> int:
    """Micro-batches of an epoch: whole steps of the real trainer."""
    return examples // (TRAINER_M * mb) * TRAINER_M


def epochs_of(data, seed: int, epochs: int, mb: int):
    """Per epoch, the micro-batches [n, mb, ...] in a seeded shuffled order."""
    import jax.numpy as jnp

    for e in range(epochs):
        p = np.random.default_rng([seed, e]).permutation(len(data.x_train))
        n = updates_per_epoch(len(p), mb)
        yield (jnp.asarray(data.x_train[p[:n * mb]]).reshape(n, mb, -1),
               jnp.asarray(data.y_train[p[:n * mb]]).reshape(n, mb))


@functools.lru_cache(maxsize=None)
def initial(model: str, seed: int, micro_batch: int) -> list[dict]:
    """The initial variables of a model for a seed, once per worker process
    (every row of a seed starts from them)."""
    import jax
    import jax.numpy as jnp

    import optax

    import pipejax as pj

    layers, _, data = setup(model)
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=optax.sgd(0.0),
                      split=1, delays=0)
    return sim.variables(jax.random.key(seed), jnp.zeros((micro_batch, data.x_train.shape[1])))


@functools.lru_cache(maxsize=None)
def setup(model: str) -> tuple:
    """(layers, accuracy, data) of a model, once per worker process."""
    import pipejax as pj

    layers = build(model)
    return layers, pj.evaluator(layers), pj.data.load("mnist1d")


def train(run: Run) -> list[dict]:
    """Train `run` once per seed; one result dict each."""
    import jax
    import jax.numpy as jnp

    import pipejax as pj

    layers, accuracy, data = setup(run.model)
    K = len(layers) if run.split == "finest" else run.split
    mb = run.micro_batch
    per_epoch = updates_per_epoch(len(data.x_train), mb)
    rate, m, peak = run.rate_and_momentum(run.epochs * per_epoch)
    # one chain with its numbers in the state: each (model, K, consistency, micro-batch
    # size) compiles once, shared by the workers through JAX's persistent cache
    mit = pj.transforms.mitigation(run.mitigation, rate, momentum=m, sweep=True)
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=mit.optimizer, split=K,
                      delays=run.delays, consistent=mit.weight_stashing)
    out = []
    for seed in run.seeds:
        start = time.perf_counter()
        init = initial(run.model, seed, mb)
        curve, losses = [], []
        if run.table == "trainer":  # the same micro-batches through the pipelined trainer
            M = TRAINER_M
            example = jnp.zeros((mb, data.x_train.shape[1]))
            pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=example, stages=K,
                               microbatches=M, schedule="pb",
                               partition=[len(r) for r in sim.ranges],
                               weight_stashing=mit.weight_stashing)
            trainer = pipe.trainer(mit.optimizer)
            state = trainer.init(pipe.stage(init), jax.random.key(seed))
            for xs, ys in epochs_of(data, seed, run.epochs, mb):
                for i in range(0, len(xs), M):
                    state, metrics = trainer.step(state, (xs[i:i + M].reshape(M * mb, -1),
                                                          ys[i:i + M].reshape(M * mb)))
                flushed, _ = trainer.flush(state)  # evaluate with nothing in flight
                curve.append(accuracy(pj.unstage(flushed.params), data.x_test, data.y_test))
                losses.append(float(metrics["loss"]))
        else:
            state = sim.init(init, jax.random.key(seed))
            for xs, ys in epochs_of(data, seed, run.epochs, mb):
                state, loss = sim.run(state, xs, ys)
                curve.append(accuracy(sim.params(state), data.x_test, data.y_test))
                losses.append(float(jnp.mean(loss[-len(loss) // 10:])))
        out.append({**run._asdict(), "K": K, "seed": seed, "seeds": None,
                    "learning_rate": peak, "momentum": m, "delays_per_stage": sim.delays,
                    "max_delay": max(sim.delays),
                    "delay_in_steps": peak / (1 - m) * max(sim.delays),
                    "test_accuracy": curve[-1], "curve": curve, "train_loss": losses,
                    "seconds": round(time.perf_counter() - start, 1)})
        print(f"{run.table} {run.model} K={K} mb={mb} {run.row} seed {seed}: "
              f"{100 * curve[-1]:.2f}% ({out[-1]['seconds']} s)", flush=True)
    return out


def runs(quick: bool) -> list[Run]:
    """Every configuration of the benchmark; `quick`: one seed, one epoch, fewer rows."""
    seeds, epochs = ((0,), 1) if quick else (tuple(range(SEEDS)), EPOCHS)
    out = []
    for model, splits in SPLITS.items():
        for i, split in enumerate(splits[:1] if quick else splits):
            for label, name, delays in MITIGATIONS:
                if delays == 0 and i > 0:
                    continue  # no delay: the split does not matter
                out.append(Run("main", model, split, label, name, delays, 1, ("eq9",), "step",
                               epochs, seeds))
        out.append(Run("trainer", model, 8, "PB + LWP_D + SC_D", "lwp+sc", "pb", 1, ("eq9",),
                       "step", epochs, (0,)))
    if quick:
        return out
    for m in SWEEP_MOMENTA:
        for label, name, delays in SWEEP_ROWS:
            out.append(Run("sweep", "resnet", 8, label, name, delays, 1, ("contribution", m),
                           "step", EPOCHS, (0,)))
    old = [(8, ("fixed", 3e-3, 0.9), "constant", 6), (8, ("eq9",), "step", EPOCHS)]
    for mb, hyper, schedule, n in old:
        for label, name, delays in (MITIGATIONS[0], MITIGATIONS[1], MITIGATIONS[-1]):
            out.append(Run("old", "resnet", 8, label, name, delays, mb, hyper, schedule, n, seeds))
    return out


def sweep_points(results: list[dict]) -> list[dict]:
    """The momentum sweep's runs: its own, and at eq. 9's momentum the main
    table's ResNet at K = 8, seed 0 (eq. 9's η′ is appendix F's for m′ = m^(1/128))."""
    rows = {label for label, *_ in SWEEP_ROWS}
    return [r for r in results if r["table"] == "sweep" or (
        (r["table"], r["model"], r["seed"]) == ("main", "resnet", 0) and r["row"] in rows
        and (r["delays"] == 0 or r["K"] == 8))]


def _mean(results: list[dict], **match) -> tuple[float, float, int]:
    accs = [100 * r["test_accuracy"] for r in results
            if all(r[k] == v for k, v in match.items())]
    return (float(np.mean(accs)), float(np.std(accs)), len(accs)) if accs else (0.0, 0.0, 0)


def summarize(results: list[dict]) -> dict:
    """The main table (Kosson et al. Table 1's shape), the trainer rows, the
    momentum sweep and the old-regime table."""
    main, trainer, sweep, old = [], [], [], []
    for model, splits in SPLITS.items():
        for K in sorted({r["K"] for r in results if r["model"] == model and r["table"] == "main"
                         and r["delays"] != 0}):
            row = {"model": model, "K": K}
            for label, _, delays in MITIGATIONS:
                mean, std, n = _mean(results, table="main", model=model, row=label,
                                     **({} if delays == 0 else {"K": K}))
                row[label] = f"{mean:.1f} ± {std:.1f}" if n else "–"
            # what the delay costs PB: points of accuracy, and its final training loss
            # (mean of the last tenth of the last epoch) against SGDM's
            sgdm, pb = (_mean(results, table="main", model=model, row=label,
                              **({} if d == 0 else {"K": K}))[0] for label, _, d in MITIGATIONS[:2])
            row[GAP] = round(sgdm - pb, 1)
            for label, _, d in MITIGATIONS[:2]:
                losses = [r["train_loss"][-1] for r in results if (r["table"], r["model"], r["row"])
                          == ("main", model, label) and (d == 0 or r["K"] == K)]
                row[f"{label.split(',')[0]} train loss"] = round(float(np.mean(losses)), 4)
            main.append(row)
        for r in results:
            if r["table"] == "trainer" and r["model"] == model:
                sim = [s for s in results if (s["table"], s["model"], s["K"], s["row"], s["seed"])
                       == ("main", model, r["K"], r["row"], r["seed"])]
                trainer.append({"model": model, "K": r["K"], "row": r["row"], "seed": r["seed"],
                                "pipe.trainer": round(100 * r["test_accuracy"], 2),
                                "pj.simulate": round(100 * sim[0]["test_accuracy"], 2)
                                if sim else None, "trainer_seconds": r["seconds"]})
    points = sweep_points(results)
    for m in sorted({round(r["momentum"], 5) for r in points}):
        row = {"momentum": m}
        for label, *_ in SWEEP_ROWS:
            accs = [100 * r["test_accuracy"] for r in points
                    if r["row"] == label and round(r["momentum"], 5) == m]
            row[label] = round(float(np.mean(accs)), 1) if accs else None
        sweep.append(row)
    three = (MITIGATIONS[0][0], MITIGATIONS[1][0], MITIGATIONS[-1][0])
    regimes: dict[tuple, list[dict]] = {}
    for r in results:  # the main table's ResNet at K = 8 is the papers' regime
        if r["table"] == "old" or (r["table"], r["model"], r["K"]) == ("main", "resnet", 8) \
                and r["row"] in three:
            key = (r["micro_batch"], tuple(r["hyper"]), r["schedule"], r["epochs"])
            regimes.setdefault(key, []).append(r)
    for (mb, hyper, schedule, epochs), rows in regimes.items():
        pb = next(x for x in rows if x["delays"] != 0)
        entry = {"micro_batch": mb, "hyper-parameters": "eq. 9" if hyper[0] == "eq9" else "fixed",
                 "lr": f"{pb['learning_rate']:.3g}", "momentum": round(pb["momentum"], 5),
                 "schedule": schedule, "epochs": epochs, "max delay D": pb["max_delay"],
                 "η/(1−m)·D": round(pb["delay_in_steps"], 3)}
        for label in three:
            mean, std, n = _mean(rows, row=label)
            entry[label] = f"{mean:.1f} ± {std:.1f}" if n else "–"
        old.append(entry)
    return {"main": main, "trainer": trainer, "momentum_sweep": sweep, "old_regime": old}


def plot(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["K"]) for r in results if r["table"] == "main"
                     and r["delays"] != 0})
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.8),
                             squeeze=False)
    for ax, (model, K) in zip(axes[0], panels):
        for label, _, delays in MITIGATIONS:
            curves = [r["curve"] for r in results if r["table"] == "main" and r["model"] == model
                      and r["row"] == label and (delays == 0 or r["K"] == K)]
            if curves:
                ax.plot(np.arange(1, len(curves[0]) + 1), 100 * np.mean(curves, 0), label=label)
        ax.set(title=f"{model}, K = {K}, micro-batch 1", xlabel="epoch",
               ylabel="test accuracy (%)", ylim=(40, 100))
        ax.legend(fontsize=6)
    ax = axes[0][-1]
    for label, *_ in SWEEP_ROWS:
        pts = sorted((r["momentum"], 100 * r["test_accuracy"]) for r in sweep_points(results)
                     if r["row"] == label)
        if pts:
            ax.plot([1 - m for m, _ in pts], [a for _, a in pts], "o-", label=label)
    ax.set(xscale="log", title="momentum sweep, ResNet K = 8 (Fig. 13)", xlabel="1 − momentum",
           ylabel="test accuracy (%)")
    ax.invert_xaxis()
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def tables() -> dict[str, str]:
    """The reproductions page's tables, from convergence.json's summary, and
    the README's headline from its ResNet rows."""
    saved = load("convergence")
    out = {name: markdown(rows) for name, rows in saved["summary"].items() if rows}
    resnet = [r for r in saved["summary"]["main"] if r["model"] == "resnet"]
    mean = lambda cell: cell.split(" ± ")[0]
    seeds = len({r["seed"] for r in saved["runs"]})
    out["headline"] = (
        f"on MNIST-1D at micro-batch 1, pipelined backpropagation alone loses "
        f"{in_words([r[GAP] for r in resnet])} accuracy points against "
        f"synchronous SGDM ({mean(resnet[0]['SGDM, no delay'])} %) on a 21-layer ResNet at "
        f"K = {in_words([r['K'] for r in resnet])} stages; with LWP_D + SC_D it reaches "
        f"{in_words([mean(r['PB + LWP_D + SC_D']) for r in resnet])} % ({seeds} seeds), "
        f"as in Kosson et al.'s Table 1.")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 epoch, the first split only")
    ap.add_argument("--summarize", action="store_true",
                    help="recompute the tables and the plot from the saved runs")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.summarize:
        saved = load("convergence")
        for r in saved["runs"]:
            r["hyper"] = tuple(r["hyper"])  # JSON made it a list
        saved["summary"] = summarize(saved["runs"])
        plot(saved["runs"], RESULTS / "convergence.png")
        (RESULTS / "convergence.json").write_text(json.dumps(saved, indent=2))
        for name, rows in saved["summary"].items():
            print(f"\n{name}\n{table(rows)}")
        return
    start = time.perf_counter()
    todo = sorted(runs(args.quick), key=lambda r: -r.cost)
    simulated = [r for r in todo if r.table != "trainer"]
    results = [r for done in in_workers(train, simulated, args.workers) for r in done]
    # The pipelined trainer runs K device threads: alone, or it crawls beside a worker.
    results += [r for run in todo if run.table == "trainer" for r in train(run)]
    summary = summarize(results)
    for name, rows in summary.items():
        if rows:
            print(f"\n{name}\n{table(rows)}")
    minutes = (time.perf_counter() - start) / 60
    print(f"\n{len(results)} runs in {minutes:.1f} min with {args.workers} workers")
    if not args.quick:
        plot(results, RESULTS / "convergence.png")
        print(f"wrote {save('convergence', {'reference': REFERENCE, 'epochs': EPOCHS, 'decay_at': DECAY_AT, 'models': MODELS, 'minutes': round(minutes, 1), 'workers': args.workers, 'summary': summary, 'runs': results})}")


if __name__ == "__main__":
    main()
