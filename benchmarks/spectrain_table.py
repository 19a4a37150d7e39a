"""SpecTrain's Table 1 on MNIST-1D: a Transformer pipelined over K = 4 stages
on PipeDream's 1F1B timeline, trained with momentum SGD (Chen et al. 2018,
§4.1, §4.4).

The paper's regime: 4 stages (one GPU each), a mini-batch of 128 per update,
momentum 0.9, a fixed learning rate, 5000 iterations; it reports the minimum
training loss, the minimum validation loss and the maximum validation
accuracy over training. We keep all of it but the length: 5000 iterations of
128 are 13 epochs of CIFAR-10 (the paper's CNNs) and 26 of IMDb (its
Transformer); 2500 are 80 epochs of MNIST-1D's 4000 examples, past the
minimum of every row's test loss, at half the cost. Rows: Data P. (no delay: every gradient at the
current weights, what data parallelism or GPipe computes), Vanilla model P.
(PipeDream's delays D_k = K − 1 − k, the backward at the current weights),
PipeDream (weight stashing: the backward at the forward's weights) and
SpecTrain (forward and backward on velocity forecasts, horizons from the
table: eqs 4–6). The learning rate is the best of a grid for Data P., the
recipe a user tunes without a pipeline and then pipelines; the Transformer is
the zoo's (4 blocks, width 64) with its 7 layers split 2, 2, 2, 1. Numbers
from `pj.simulate`, 3 seeds; the MNIST-1D test set is the validation set.

Run: python benchmarks/spectrain_table.py [--quick] [--workers 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools
import time
from typing import NamedTuple

import numpy as np

from common import in_workers, load, markdown, save, table

K, BATCH, MOMENTUM, ITERATIONS, EVERY, SEEDS = 4, 128, 0.9, 2500, 125, 3
RATES = (0.01, 0.03, 0.1)  # the grid for Data P.
ROWS = [("Data P. (no delay)", "none", 0), ("Vanilla model P.", "none", "pipedream"),
        ("PipeDream (stash)", "stash", "pipedream"), ("SpecTrain", "spectrain", "pipedream")]


class Run(NamedTuple):
    row: str
    mitigation: str
    delays: int | str
    learning_rate: float
    seed: int
    iterations: int


@functools.lru_cache(maxsize=None)
def setup() -> tuple:
    """(layers, test loss and accuracy, data), once per worker process."""
    import jax
    import jax.numpy as jnp

    import pipejax as pj

    layers = pj.models.transformer(layers=4, dim=64, heads=4)
    data = pj.data.load("mnist1d")
    x, y = jnp.asarray(data.x_test), jnp.asarray(data.y_test)

    @jax.jit
    def evaluate(variables):
        logits = pj.apply_layers(layers, variables, x, train=False)
        return pj.losses.cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    return layers, evaluate, data


def stream(data, seed: int, iterations: int):
    """Mini-batches [EVERY, BATCH, ...] of shuffled epochs (each dropping its remainder)."""
    import jax.numpy as jnp

    per_epoch = len(data.x_train) // BATCH
    order = np.concatenate([np.random.default_rng([seed, e]).permutation(len(data.x_train))
                            [:per_epoch * BATCH] for e in range(-(-iterations // per_epoch))])
    order = order[:iterations * BATCH].reshape(-1, EVERY, BATCH)
    for idx in order:
        yield jnp.asarray(data.x_train[idx]), jnp.asarray(data.y_train[idx])


def train(run: Run) -> dict:
    import jax
    import jax.numpy as jnp

    import pipejax as pj

    layers, evaluate, data = setup()
    mit = pj.transforms.mitigation(run.mitigation, run.learning_rate, momentum=MOMENTUM,
                                   sweep=True)
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=mit.optimizer, split=K,
                      delays=run.delays, consistent=mit.weight_stashing)
    start = time.perf_counter()
    state = sim.init(sim.variables(jax.random.key(run.seed), jnp.zeros((BATCH, 40))))
    train_loss, test_loss, test_accuracy = [], [], []
    for xs, ys in stream(data, run.seed, run.iterations):
        state, losses = sim.run(state, xs, ys)
        loss, accuracy = evaluate(sim.params(state))
        train_loss.append(float(jnp.mean(losses)))
        test_loss.append(float(loss))
        test_accuracy.append(float(accuracy))
    result = {**run._asdict(), "delays_per_stage": sim.delays, "train_loss": train_loss,
              "test_loss": test_loss, "test_accuracy": test_accuracy,
              "min_train_loss": float(np.nanmin(train_loss)),
              "min_test_loss": float(np.nanmin(test_loss)),
              "max_test_accuracy": float(np.max(test_accuracy)),
              "final_test_accuracy": test_accuracy[-1],
              "seconds": round(time.perf_counter() - start, 1)}
    print(f"{run.row} lr {run.learning_rate} seed {run.seed}: max accuracy "
          f"{100 * result['max_test_accuracy']:.2f}%, min test loss {result['min_test_loss']:.4f} "
          f"({result['seconds']} s)", flush=True)
    return result


def summarize(results: list[dict], lr: float) -> list[dict]:
    rows = []
    for label, *_ in ROWS:
        runs = [r for r in results if r["row"] == label and r["learning_rate"] == lr]
        row = {"parallelization": label, "seeds": len(runs)}
        for key, scale, digits in (("min_train_loss", 1, 4), ("min_test_loss", 1, 4),
                                   ("max_test_accuracy", 100, 2), ("final_test_accuracy", 100, 2)):
            values = scale * np.array([r[key] for r in runs])
            row[key] = f"{values.mean():.{digits}f} ± {values.std():.{digits}f}"
        rows.append(row)
    return rows


def tables() -> dict[str, str]:
    """The reproductions page's table, from spectrain_table.json's summary."""
    return {"summary": markdown(load("spectrain_table")["summary"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1 seed, 250 iterations")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    start = time.perf_counter()
    seeds, iterations = (1, 2 * EVERY) if args.quick else (SEEDS, ITERATIONS)
    grid = in_workers(train, [Run(ROWS[0][0], "none", 0, lr, 0, iterations) for lr in RATES],
                      args.workers)
    best = max(grid, key=lambda r: r["max_test_accuracy"])["learning_rate"]
    todo = [Run(label, name, delays, best, seed, iterations) for label, name, delays in ROWS
            for seed in range(seeds) if (label, seed) != (ROWS[0][0], 0)]
    results = [r for r in grid if r["learning_rate"] == best] + in_workers(train, todo,
                                                                           args.workers)
    summary = summarize(results, best)
    print(f"\nlearning rate {best} (best of {RATES} for Data P., seed 0)\n{table(summary)}")
    minutes = (time.perf_counter() - start) / 60
    print(f"{len(grid) + len(todo)} runs in {minutes:.1f} min with {args.workers} workers")
    if not args.quick:
        print(f"wrote {save('spectrain_table', {'stages': K, 'batch': BATCH, 'momentum': MOMENTUM, 'iterations': ITERATIONS, 'rates': RATES, 'learning_rate': best, 'grid': [{k: g[k] for k in ('learning_rate', 'max_test_accuracy', 'min_test_loss')} for g in grid], 'minutes': round(minutes, 1), 'summary': summary, 'runs': results})}")


if __name__ == "__main__":
    main()
