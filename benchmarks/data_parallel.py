"""Decentralized data parallelism over pipeline replicas (H-ADPSGD §5; MXNET-MPI §5).

8 replicas of a 2-stage GPipe pipeline (16 simulated devices) train an MLP
on MNIST-1D under each rule: SSGD (all-reduce of the gradients), ADPSGD
(ring gossip over the 8), H-ADPSGD (2 nodes x 4 local: all-reduce inside a
node, gossip between nodes) and elastic averaging (8 clients, alpha = 0.9/8,
every 4 steps). Global batch 1x, 4x and 16x a baseline of 64 (8 per replica),
the same epochs, SGD with momentum at a learning rate scaled linearly with
the batch. Reported: final test accuracy of the replicas' mean model (mean
and spread over seeds), the loss curve and the consensus distance (spread of
the replicas' weights), per epoch.

Run: python benchmarks/data_parallel.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from common import RESULTS, load, markdown, save, table

R, K, M, BASE, LR, MOMENTUM = 8, 2, 2, 64, 0.02, 0.9
RULES = {  # name: (rule, mesh nodes)
    "SSGD": (lambda: None, 1),
    "ADPSGD": (lambda: pj.transforms.adpsgd("data"), 1),
    "H-ADPSGD": (lambda: pj.transforms.hadpsgd("node", "local"), 2),
    "elastic": (lambda: pj.transforms.elastic("data", alpha=0.9 / R, every=4), 1),
}


def run(name: str, scale: int, epochs: int, data, seed: int = 0) -> dict:
    make_rule, nodes = RULES[name]
    batch = BASE * scale
    layers = pj.models.mlp(depth=4, width=128, classes=data.classes)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                       example=jnp.zeros((batch // (R * M), data.x_train.shape[1])),
                       stages=K, microbatches=M, mesh=pj.make_mesh(K, R, nodes))
    trainer = pipe.trainer(optax.sgd(LR * scale, momentum=MOMENTUM), rule=make_rule())
    state = trainer.init(pipe.init(jax.random.key(seed)))
    curve, spread, start = [], [], time.perf_counter()
    for epoch in range(epochs):
        losses = []
        for x, y in pj.data.batches(data.x_train, data.y_train, batch, seed, epoch):
            state, metrics = trainer.step(state, (x, y))
            losses.append(metrics["loss"])
        curve.append(float(np.mean(jax.device_get(losses))))
        spread.append(float(metrics.get("consensus_distance", 0.0)))
    final = pj.evaluator(layers)(pj.unstage(state), data.x_test, data.y_test)
    return {"rule": name, "batch": batch, "scale": scale, "lr": LR * scale,
            "steps": epochs * (len(data.x_train) // batch), "test_accuracy": final,
            "final_loss": curve[-1], "final_consensus": spread[-1],
            "loss_curve": curve, "consensus_curve": spread,
            "seconds": round(time.perf_counter() - start, 1)}


def plot(results: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({r["scale"] for r in results})
    fig, axes = plt.subplots(2, len(scales) + 1, figsize=(4 * (len(scales) + 1), 6.5))
    for j, s in enumerate(scales):
        for r in (r for r in results if r["scale"] == s):
            axes[0, j].plot(r["loss_curve"], label=r["rule"])
            axes[1, j].plot(r["consensus_curve"], label=r["rule"])
        axes[0, j].set_title(f"global batch {BASE * s} ({s}x)")
        axes[0, j].set_yscale("log"), axes[1, j].set_xlabel("epoch")
    axes[0, 0].set_ylabel("train loss"), axes[1, 0].set_ylabel("consensus distance")
    axes[0, 0].legend()
    for name in RULES:
        rows = [r for r in results if r["rule"] == name]
        axes[0, -1].plot([r["scale"] for r in rows], [100 * r["test_accuracy"] for r in rows],
                         "o-", label=name)
    axes[0, -1].set_xscale("log", base=2), axes[0, -1].set_xlabel("batch multiple")
    axes[0, -1].set_ylabel("test accuracy (%)"), axes[0, -1].legend()
    axes[1, -1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


LABELS = {"SSGD": "SSGD", "ADPSGD": f"ADPSGD (ring of {R})", "H-ADPSGD": "H-ADPSGD (2 nodes × 4)",
          "elastic": f"elastic (alpha 0.9/{R}, every 4)"}


def tables() -> dict[str, str]:
    """The data-parallel page's table from data_parallel.json: test accuracy
    (%, mean ± std over the seeds) of each rule at each global batch."""
    results = load("data_parallel")["results"]
    cell = {(r["rule"], r["batch"]): f"{100 * r['test_accuracy']:.1f} ± {100 * r['test_accuracy_std']:.1f}"
            for r in results}
    batches = sorted({r["batch"] for r in results})
    return {"accuracy": markdown([{"rule": label, **{f"batch {b}": cell.get((rule, b)) for b in batches}}
                                  for rule, label in LABELS.items()])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs, for a smoke run")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    epochs, seeds = (3, 1) if args.quick else (args.epochs, args.seeds)
    data = pj.data.mnist1d()
    results = []
    for scale in (1, 4, 16):
        for name in RULES:
            runs = [run(name, scale, epochs, data, seed) for seed in range(seeds)]
            acc = [r["test_accuracy"] for r in runs]
            results.append({**runs[0], "test_accuracy": float(np.mean(acc)),
                            "test_accuracy_std": float(np.std(acc)), "seeds": acc,
                            "final_loss": float(np.mean([r["final_loss"] for r in runs])),
                            "final_consensus": float(np.mean([r["final_consensus"] for r in runs]))})
    print(table([{"rule": r["rule"], "batch": r["batch"], "lr": f"{r['lr']:.2f}",
                  "steps": r["steps"],
                  "test acc %": f"{100 * r['test_accuracy']:.1f} ± {100 * r['test_accuracy_std']:.1f}",
                  "final loss": f"{r['final_loss']:.3f}",
                  "consensus": f"{r['final_consensus']:.3g}", "s": r["seconds"]}
                 for r in results]))
    name = "data_parallel_quick" if args.quick else "data_parallel"
    print(f"wrote {save(name, {'replicas': R, 'stages': K, 'microbatches': M, 'base_batch': BASE, 'base_lr': LR, 'momentum': MOMENTUM, 'epochs': epochs, 'results': results})}")
    if not args.quick:
        plot(results, RESULTS / "data_parallel.png")


if __name__ == "__main__":
    main()
