"""Convergence of pipelined backpropagation with each staleness mitigation
(SpecTrain Table 1; Kosson et al. 2020, Table 1), on MNIST-1D.

Fine-grained pipelines (a stage per layer or two), micro-batch size 8, one
update per micro-batch. Rows: SGDM without delay (what GPipe with M = 1
computes: the synchronous baseline at the same update size), PB, PB + weight
stashing, PB + SpecTrain, PB + LWP_D, PB + SC_D, PB + LWP_D + SC_D; and an
Adam row pair on a Transformer (PB, PB + LWP_D in the difference form).
Final test accuracy, mean ± std over seeds, from `pj.simulate`; one row per
model is rerun with the real multi-device trainer (`pipe.trainer`) on the
same micro-batches, to show that the sweep's numbers are the executor's.

Run: python benchmarks/convergence.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
from common import RESULTS, save, table

MB = 8
ROWS = [("SGDM, no delay (GPipe, M = 1)", "none", 0), ("PB", "none", "pb"),
        ("PB + weight stashing", "stash", "pb"), ("PB + SpecTrain", "spectrain", "pb"),
        ("PB + LWP_D", "lwp", "pb"), ("PB + SC_D", "sc", "pb"), ("PB + LWP_D + SC_D", "lwp+sc", "pb")]
# model: (layers, stage counts, optimizer, learning rate, momentum, epochs, rows, real-trainer row)
MODELS = {
    "mlp": (lambda: pj.models.mlp(8, 128, 10), (8, 16), "momentum", 3e-3, 0.9, 15, ROWS,
            "PB + LWP_D + SC_D"),
    "resnet": (lambda: pj.models.resnet(depth=6, width=16, groups=4, classes=10, dims=1), (8,),
               "momentum", 3e-3, 0.9, 6, ROWS, "PB"),
    "transformer": (lambda: pj.models.transformer(layers=4, dim=64, heads=4, classes=10), (6,),
                    "adam", 1e-3, 0.0, 10, [("PB", "none", "pb"), ("PB + LWP_D", "lwp", "pb")],
                    "PB + LWP_D"),
}


def epochs_of(data, seed: int, epochs: int):
    """Per epoch, the micro-batches [n, MB, ...] in a seeded shuffled order."""
    for e in range(epochs):
        p = np.random.default_rng([seed, e]).permutation(len(data.x_train))
        n = len(p) // (8 * MB) * 8  # whole steps of the real trainer's M = 8
        yield (jnp.asarray(data.x_train[p[:n * MB]]).reshape(n, MB, -1),
               jnp.asarray(data.y_train[p[:n * MB]]).reshape(n, MB))


def run(model: str, K: int, row: tuple, seed: int, data, real: bool = False,
        epochs: int | None = None) -> dict:
    build, _, opt_name, lr, momentum, default_epochs, _, _ = MODELS[model]
    epochs = epochs or default_epochs
    label, mitigation, delays = row
    layers = build()
    mit = pj.transforms.mitigation(mitigation, lr, momentum=momentum, optimizer=opt_name)
    example = jnp.zeros((MB, data.x_train.shape[1]))
    init = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=example, stages=1,
                       microbatches=1).init(jax.random.key(seed))
    predict = jax.jit(lambda v, x: pj.apply_layers(layers, v, x, train=False))
    accuracy = lambda v: float(np.mean(np.argmax(predict(v, data.x_test), -1) == data.y_test))
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=mit.optimizer, split=K,
                      delays=delays, consistent=mit.weight_stashing)
    curve, losses, start = [], [], time.perf_counter()
    if real:  # the same micro-batches through the pipelined trainer, M = 8 per step
        M = 8
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=example, stages=K,
                           microbatches=M, schedule="gpipe" if delays == 0 else "pb",
                           partition=[len(r) for r in sim.ranges],
                           weight_stashing=mit.weight_stashing)
        trainer = pipe.trainer(mit.optimizer)
        state = trainer.init(pipe.stage(pj.unstage(init)), jax.random.key(seed))
        for xs, ys in epochs_of(data, seed, epochs):
            for i in range(0, len(xs) - M + 1, M):
                state, m = trainer.step(state, (xs[i:i + M].reshape(M * MB, -1),
                                                ys[i:i + M].reshape(M * MB)))
            flushed, _ = trainer.flush(state)  # evaluate the weights with nothing in flight
            curve.append(accuracy(pj.unstage(flushed.params)))
            losses.append(float(m["loss"]))
        state, _ = trainer.flush(state)
    else:
        state = sim.init(pj.unstage(init), jax.random.key(seed))
        for xs, ys in epochs_of(data, seed, epochs):
            state, loss = sim.run(state, xs, ys)
            curve.append(accuracy(sim.params(state)))
            losses.append(float(jnp.mean(loss[-100:])))
    return {"model": model, "K": K, "row": label, "seed": seed, "real_trainer": real,
            "test_accuracy": curve[-1], "curve": curve, "train_loss": losses,
            "delays": sim.delays, "seconds": round(time.perf_counter() - start, 1)}


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for model, (_, Ks, *_rest) in MODELS.items():
        labels = [r[0] for r in MODELS[model][6]]
        for K in Ks:
            for label in labels:
                for real in (False, True):
                    accs = [100 * r["test_accuracy"] for r in results if (r["model"], r["K"],
                            r["row"], r["real_trainer"]) == (model, K, label, real)]
                    if accs:
                        rows.append({"model": model, "K": K, "row": label + (" [pipe.trainer]"
                                                                              if real else ""),
                                     "seeds": len(accs),
                                     "test_accuracy_%": f"{np.mean(accs):.2f} ± {np.std(accs):.2f}"})
    return rows


def plot(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, K) for m, spec in MODELS.items() for K in spec[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (model, K) in zip(axes[0], panels):
        for label in [r[0] for r in MODELS[model][6]]:
            curves = [r["curve"] for r in results if (r["model"], r["K"], r["row"]) == (model, K, label)
                      and not r["real_trainer"]]
            if curves:
                ax.plot(np.arange(1, len(curves[0]) + 1), 100 * np.mean(curves, 0), label=label)
        ax.set(title=f"{model}, K = {K}", xlabel="epoch", ylabel="test accuracy (%)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 epoch: a smoke test")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    data = pj.data.load("mnist1d")
    seeds, epochs = (1, 1) if args.quick else (args.seeds, None)
    results = []
    for model, (_, Ks, _, _, _, _, rows, real_row) in MODELS.items():
        for K in Ks:
            for row in rows:
                for seed in range(seeds):
                    results.append(run(model, K, row, seed, data, epochs=epochs))
                    r = results[-1]
                    print(f"{model} K={K} {row[0]} seed {seed}: {100 * r['test_accuracy']:.2f}% "
                          f"({r['seconds']} s)", flush=True)
        row = next(r for r in rows if r[0] == real_row)
        results.append(run(model, Ks[0], row, 0, data, real=True, epochs=epochs))
        print(f"{model} K={Ks[0]} {row[0]} [pipe.trainer] seed 0: "
              f"{100 * results[-1]['test_accuracy']:.2f}% ({results[-1]['seconds']} s)", flush=True)
    summary = summarize(results)
    print(table(summary))
    if not args.quick:
        plot(results, RESULTS / "convergence.png")
        save("convergence", {"micro_batch": MB, "models": {m: {"stages": s[1], "optimizer": s[2],
                             "lr": s[3], "momentum": s[4], "epochs": s[5]} for m, s in MODELS.items()},
                             "summary": summary, "runs": results})


if __name__ == "__main__":
    main()
