"""`pipejax train` and `pipejax plan`: the library's data flow from the shell.

The CLI holds no logic the library lacks: it builds a layer list from
`pipejax.models`, calls `pj.pipeline`, and loops over `pipe.step`. When fewer
devices exist than stages, it sets up simulated CPU devices before JAX starts.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

# Per model: keyword arguments of its builder and the training settings that
# reach the README's accuracies on MNIST-1D (4 stages, GPipe).
MODEL_DEFAULTS = {
    "mlp": ({"depth": 4, "width": 256}, {"lr": 1e-3, "epochs": 60}),
    "snn": ({"depth": 16, "width": 128}, {"lr": 3e-4, "epochs": 40}),
    "resnet": ({"depth": 6, "width": 32, "groups": 8}, {"lr": 3e-3, "epochs": 15}),
    "vgg": ({}, {"lr": 1e-3, "epochs": 30}),
    "transformer": ({"layers": 4, "dim": 64, "heads": 4}, {"lr": 1e-3, "epochs": 40}),
    "residual_lstm": ({"layers": 3, "hidden": 64}, {"lr": 3e-3, "epochs": 15}),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipejax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(q):
        q.add_argument("--model", default="mlp", choices=sorted(MODEL_DEFAULTS))
        q.add_argument("--data", default="mnist1d", help="mnist1d | digits | path to a .npz file")
        q.add_argument("--stages", type=int, default=4)
        q.add_argument("--microbatches", type=int, default=4)
        q.add_argument("--batch-size", type=int, default=128)
        q.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "pipedream", "pb"])
        q.add_argument("--partition", default="variance",
                       help="variance | bottleneck | comma-separated layer counts, e.g. 3,2,2,2")
        q.add_argument("--remat", default="stage", choices=["none", "stage"])

    train = sub.add_parser("train", help="train a model with a pipelined step")
    common(train)
    train.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    train.add_argument("--lr", type=float, default=None, help="default: the model's")
    train.add_argument("--epochs", type=int, default=None, help="default: the model's")
    train.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-every", type=int, default=0, help="steps between test evaluations")
    train.add_argument("--out", type=Path, default=None,
                       help="write metrics.jsonl, metrics.csv, curve.png, params.msgpack here")
    train.add_argument("--quiet", action="store_true", help="no progress bar")

    plan = sub.add_parser("plan", help="print the partition table and the schedule timeline")
    common(plan)
    plan.add_argument("--plot", type=Path, default=None, help="also draw the timeline to this PNG")
    return p


def _setup_devices(stages: int):
    """Simulate CPU devices if needed; return a mesh or None (the default one)."""
    import pipejax as pj

    pj.simulate_devices(max(stages, 1))
    import jax
    import numpy as np
    from jax.sharding import Mesh

    if len(jax.devices()) >= stages:
        return None
    return Mesh(np.array(jax.devices("cpu")[:stages]), ("stage",))


def build_layers(name: str, example_shape: tuple, classes: int) -> list:
    """The named model for examples of `example_shape` (signals [L] or images [H, W, C])."""
    import pipejax as pj
    from pipejax.models.common import flatten

    kwargs, _ = MODEL_DEFAULTS[name]
    image = len(example_shape) == 3
    if name in ("resnet", "vgg"):
        return pj.models.MODELS[name](**kwargs, classes=classes, dims=2 if image else 1)
    layers = pj.models.MODELS[name](**kwargs, classes=classes)
    # The MLP, and the sequence models on images, read flat vectors (the SNN flattens itself).
    needs_flat = name == "mlp" or (image and name != "snn")
    return [flatten] + layers if needs_flat else layers


def _pipeline(args, example_shape, classes: int, mesh):
    import jax.numpy as jnp

    import pipejax as pj

    partition = args.partition
    if partition not in ("variance", "bottleneck"):
        partition = [int(n) for n in partition.split(",")]
    layers = build_layers(args.model, example_shape, classes)
    mb = args.batch_size // args.microbatches
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, *example_shape), jnp.float32),
                       stages=args.stages, microbatches=args.microbatches,
                       schedule=args.schedule, partition=partition, remat=args.remat, mesh=mesh)
    return layers, pipe


def _optimizer(name: str, lr: float):
    import optax

    return {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
            "adam": lambda: optax.adam(lr)}[name]()


def plan(args) -> int:
    import pipejax as pj

    mesh = _setup_devices(args.stages)
    data = pj.data.load(args.data)
    _, pipe = _pipeline(args, data.x_train.shape[1:], data.classes, mesh)
    print(pipe.plan)
    print()
    print(pipe.schedule.render())
    info = [pipe.schedule.stage_info(k) for k in range(pipe.K)]
    print("delays D_k " + str([i.delay for i in info]) + ", SpecTrain horizons (forward, backward) "
          + str([(i.forward_horizon, i.backward_horizon) for i in info]))
    if args.plot:
        pipe.schedule.plot(str(args.plot))
        print(f"timeline drawn to {args.plot}")
    return 0


def _write_outputs(out: Path, rows: list[dict], summary: dict, variables) -> None:
    """metrics.jsonl (last line: the summary), metrics.csv, curve.png, params.msgpack."""
    import flax.serialization
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out / "metrics.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps(summary) + "\n")
    keys = sorted({k for row in rows for k in row})
    with (out / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r],
            label="train loss")
    evals = [r for r in rows if "test_accuracy" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["test_accuracy"] for r in evals], "o-",
                 color="tab:orange", label="test accuracy")
        ax2.set_ylabel("test accuracy")
    ax.set_xlabel("step"), ax.set_ylabel("loss")
    if all(r["loss"] > 0 for r in rows if "loss" in r):
        ax.set_yscale("log")
    ax.set_title(f"test accuracy {100 * summary['test_accuracy']:.2f}%")
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)
    plt.close(fig)
    (out / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(
        {str(i): v for i, v in enumerate(variables)}))


def train(args) -> int:
    import pipejax as pj

    mesh = _setup_devices(args.stages)
    import jax
    import numpy as np
    from tqdm import tqdm

    data = pj.data.load(args.data)
    if args.batch_size % args.microbatches:
        raise pj.errors.ConfigError(f"--batch-size {args.batch_size} is not divisible by "
                                    f"--microbatches {args.microbatches}")
    defaults = MODEL_DEFAULTS[args.model][1]
    lr = args.lr if args.lr is not None else defaults["lr"]
    epochs = args.epochs if args.epochs is not None else defaults["epochs"]
    layers, pipe = _pipeline(args, data.x_train.shape[1:], data.classes, mesh)
    print(pipe.plan, flush=True)
    state = pipe.init_state(pipe.init(jax.random.key(args.seed)), _optimizer(args.optimizer, lr),
                            key=jax.random.key(args.seed + 1))
    per_epoch = len(data.x_train) // args.batch_size
    total = args.steps if args.steps is not None else epochs * per_epoch
    predict = jax.jit(lambda v, x: pj.apply_layers(layers, v, x, train=False))

    def accuracy(variables, x, y) -> float:
        hits = sum(int(np.sum(np.argmax(np.asarray(predict(variables, x[i:i + 500])), -1)
                              == y[i:i + 500])) for i in range(0, len(x), 500))
        return hits / len(x)

    rows: list[dict] = []
    bar = tqdm(total=total, unit="step", disable=args.quiet, dynamic_ncols=True)
    step, start, epoch, loss = 0, time.perf_counter(), 0, float("nan")
    while step < total:
        for x, y in pj.data.batches(data.x_train, data.y_train, args.batch_size, args.seed, epoch):
            if step == total:
                break
            state, metrics = pipe.step(state, (x, y))
            step += 1
            if step % 20 == 0 or step == total:
                loss = float(metrics["loss"])
                rate = step * args.batch_size / (time.perf_counter() - start)
                bar.set_postfix(loss=f"{loss:.4f}", ex_per_s=f"{rate:.0f}")
                rows.append({"step": step, "epoch": epoch, "loss": loss})
            if args.eval_every and step % args.eval_every == 0:
                acc = accuracy(pj.unstage(state.params), data.x_test, data.y_test)
                rows.append({"step": step, "epoch": epoch, "test_accuracy": acc})
                bar.write(f"step {step}: test accuracy {100 * acc:.2f}%")
            bar.update(1)
        epoch += 1
    bar.close()
    state, _ = pipe.flush(state)  # an asynchronous pipeline finishes what is in flight
    seconds = time.perf_counter() - start
    variables = pj.unstage(state.params)
    summary = {"test_accuracy": accuracy(variables, data.x_test, data.y_test),
               "train_accuracy": accuracy(variables, data.x_train, data.y_train),
               "steps": step, "seconds": round(seconds, 1),
               "examples_per_s": round(step * args.batch_size / seconds, 1),
               "model": args.model, "schedule": args.schedule, "stages": args.stages,
               "split": list(pipe.plan.split)}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        _write_outputs(args.out, rows, summary, variables)
    print(f"\n{'test accuracy':<16}{100 * summary['test_accuracy']:.2f}%\n"
          f"{'train accuracy':<16}{100 * summary['train_accuracy']:.2f}%\n"
          f"{'steps':<16}{step} in {seconds:.0f} s ({summary['examples_per_s']:.0f} examples/s)\n"
          f"{'stages':<16}{args.stages} x {pipe.plan.split} layers, {args.schedule}, "
          f"{args.microbatches} micro-batches")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from pipejax.errors import PipejaxError

    try:
        return {"train": train, "plan": plan}[args.command](args)
    except PipejaxError as err:
        print(f"pipejax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
