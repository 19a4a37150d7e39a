"""`pipejax train` and `pipejax plan`: the library's data flow from the shell.

The CLI holds no logic the library lacks: it builds a layer list, calls
`pj.pipeline`, and loops over `pipe.step`. When fewer devices exist than
stages, it sets up simulated CPU devices before JAX starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipejax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(q):
        q.add_argument("--data", default="mnist1d", help="mnist1d | digits | path to a .npz file")
        q.add_argument("--depth", type=int, default=4, help="hidden layers of the default MLP")
        q.add_argument("--width", type=int, default=256, help="width of the default MLP")
        q.add_argument("--stages", type=int, default=4)
        q.add_argument("--microbatches", type=int, default=4)
        q.add_argument("--batch-size", type=int, default=128)
        q.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "pipedream", "pb"])
        q.add_argument("--partition", default="variance",
                       help="variance | bottleneck | comma-separated layer counts, e.g. 3,2,2,2")
        q.add_argument("--remat", default="stage", choices=["none", "stage"])

    train = sub.add_parser("train", help="train the default MLP with a pipelined step")
    common(train)
    train.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "adam"])
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--epochs", type=int, default=60)
    train.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", type=Path, default=None, help="write metrics.jsonl here")
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


def _pipeline(args, example_shape, classes: int, mesh):
    import jax.numpy as jnp

    import pipejax as pj

    partition = args.partition
    if partition not in ("variance", "bottleneck"):
        partition = [int(n) for n in partition.split(",")]
    layers = [lambda x: x.reshape(x.shape[0], -1)] if len(example_shape) > 1 else []
    layers += pj.models.mlp(depth=args.depth, width=args.width, classes=classes)
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
    layers, pipe = _pipeline(args, data.x_train.shape[1:], data.classes, mesh)
    print(pipe.plan, flush=True)
    state = pipe.init_state(pipe.init(jax.random.key(args.seed)), _optimizer(args.optimizer, args.lr),
                            key=jax.random.key(args.seed + 1))
    per_epoch = len(data.x_train) // args.batch_size
    total = args.steps if args.steps is not None else args.epochs * per_epoch
    predict = jax.jit(lambda v, x: pj.apply_layers(layers, v, x, train=False))

    def accuracy(x, y) -> float:
        logits = predict(pj.unstage(state.params), x)
        return float(np.mean(np.argmax(np.asarray(logits), -1) == y))

    log = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        log = (args.out / "metrics.jsonl").open("w")
    bar = tqdm(total=total, unit="step", disable=args.quiet, dynamic_ncols=True)
    step, start, epoch = 0, time.perf_counter(), 0
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
                if log:
                    log.write(json.dumps({"step": step, "epoch": epoch, "loss": loss}) + "\n")
            bar.update(1)
        epoch += 1
    bar.close()
    state, _ = pipe.flush(state)  # an asynchronous pipeline finishes what is in flight
    seconds = time.perf_counter() - start
    test_acc = accuracy(data.x_test, data.y_test)
    summary = {"test_accuracy": test_acc, "train_accuracy": accuracy(data.x_train, data.y_train),
               "steps": step, "seconds": round(seconds, 1),
               "examples_per_s": round(step * args.batch_size / seconds, 1)}
    if log:
        log.write(json.dumps(summary) + "\n")
        log.close()
    print(f"test accuracy {100 * test_acc:.2f}%  (train {100 * summary['train_accuracy']:.2f}%, "
          f"{step} steps in {seconds:.0f} s, {summary['examples_per_s']:.0f} examples/s)")
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
