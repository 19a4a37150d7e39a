"""`pipejax train`: train a model with a pipelined step; metrics, curve and parameters out."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from pipejax.cli.setup import (MODEL_DEFAULTS, describe_optimizer, make_optimizer, make_pipeline,
                              resolve_batch_size, setup_devices)


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


def _loop(args, trainer, state, data, total: int, accuracy):
    """Steps `state.step` to `total` over shuffled epochs (a resumed run goes
    on with the batch it would have had next), then a flush; returns the
    state, the metric rows and the seconds it took."""
    import pipejax as pj
    from tqdm import tqdm

    rows: list[dict] = []
    step, start = int(state.step), time.perf_counter()
    per_epoch = len(data.x_train) // args.batch_size
    epoch, skip = divmod(step, per_epoch)
    bar = tqdm(total=total, initial=step, unit="step", disable=args.quiet, dynamic_ncols=True)
    while step < total:
        for x, y in pj.data.batches(data.x_train, data.y_train, args.batch_size, args.seed, epoch):
            if skip:
                skip -= 1
                continue
            if step == total:
                break
            state, metrics = trainer.step(state, (x, y))
            step += 1
            if args.save_every and step % args.save_every == 0:
                pj.save(args.resume, trainer, state)
            if (step % 20 == 0 or step == total) and int(metrics["completed"]):
                loss = float(metrics["loss"])
                rate = step * args.batch_size / (time.perf_counter() - start)
                bar.set_postfix(loss=f"{loss:.4f}", ex_per_s=f"{rate:.0f}")
                rows.append({"step": step, "epoch": epoch, "loss": loss})
                if "skipped" in metrics:
                    rows[-1]["skipped"] = int(metrics["skipped"])
                if "consensus_distance" in metrics:
                    rows[-1]["consensus_distance"] = float(metrics["consensus_distance"])
            if args.eval_every and step % args.eval_every == 0:
                acc = accuracy(pj.unstage(state), data.x_test, data.y_test)
                rows.append({"step": step, "epoch": epoch, "test_accuracy": acc})
                bar.write(f"step {step}: test accuracy {100 * acc:.2f}%")
            bar.update(1)
        epoch += 1
    bar.close()
    state, _ = trainer.flush(state)  # an asynchronous pipeline finishes what is in flight
    if args.resume is not None:
        pj.save(args.resume, trainer, state)
    return state, rows, time.perf_counter() - start


def _rule(args):
    """The data rule the flags name (None: the trainer's default, SSGD)."""
    import pipejax as pj

    T = pj.transforms
    if args.rule is None or args.rule == "ssgd":
        return None
    if args.rule == "hadpsgd" or args.nodes > 1:
        if args.rule == "adpsgd":
            raise pj.errors.ConfigError("--rule adpsgd gossips over all replicas; with --nodes "
                                        "use --rule hadpsgd (or elastic, ssgd)")
        return (T.hadpsgd() if args.rule == "hadpsgd" else
                T.elastic("node", args.alpha, args.every, local="local"))
    return T.adpsgd() if args.rule == "adpsgd" else T.elastic("data", args.alpha, args.every)


def train(args) -> int:
    import jax

    import pipejax as pj

    args.batch_size = resolve_batch_size(args)
    args.optimizer = args.optimizer or ("momentum" if args.reference else "adam")
    mesh = setup_devices(args.stages, args.replicas, args.nodes)
    data = pj.data.load(args.data)
    if args.batch_size % (args.microbatches * args.replicas):
        raise pj.errors.ConfigError(f"--batch-size {args.batch_size} is not divisible by "
                                    f"--microbatches {args.microbatches} x --replicas "
                                    f"{args.replicas}")
    if args.save_every and args.resume is None:
        raise pj.errors.ConfigError("--save-every N writes checkpoints into --resume DIR; give "
                                    "the directory")
    if jax.process_index() > 0:  # one process reports for the job
        args.quiet, args.out, args.eval_every = True, None, 0
    defaults = MODEL_DEFAULTS[args.model][1]
    lr = args.lr if args.lr is not None else defaults["lr"]
    epochs = args.epochs if args.epochs is not None else defaults["epochs"]
    per_epoch = len(data.x_train) // args.batch_size
    total = args.steps if args.steps is not None else epochs * per_epoch
    synchronous = pj.schedules.make_schedule(args.schedule, 1, 1).synchronous
    per_step = 1 if synchronous else args.microbatches  # a stage's updates per step
    optimizer, stash, settings = make_optimizer(
        args, lr, (total * per_step, per_epoch * per_step),
        args.batch_size // (1 if synchronous else args.microbatches), synchronous)
    layers, pipe = make_pipeline(args, data.x_train.shape[1:], data.classes, mesh, stash)
    if jax.process_index() == 0:
        print(pipe, flush=True)
        print(f"optimizer: {describe_optimizer(settings)}", flush=True)
    trainer = pipe.trainer(optimizer, _rule(args), clip_norm=args.clip,
                           skip_nonfinite=args.skip_nonfinite)
    if args.resume is not None and pj.checkpoint.latest(args.resume) is not None:
        state = pj.restore(args.resume, trainer)
        if jax.process_index() == 0:
            print(f"resumed from step {int(state.step)} in {args.resume}", flush=True)
    else:
        state = trainer.init(pipe.init(jax.random.key(args.seed)), jax.random.key(args.seed + 1))
    accuracy = pj.evaluator(layers)
    first = int(state.step)
    state, rows, seconds = _loop(args, trainer, state, data, total, accuracy)
    variables = pj.unstage(state)  # gathered from every process; the replicas' mean
    summary = {"test_accuracy": accuracy(variables, data.x_test, data.y_test),
               "train_accuracy": accuracy(variables, data.x_train, data.y_train),
               "steps": total, "seconds": round(seconds, 1),
               "examples_per_s": round((total - first) * args.batch_size / seconds, 1),
               "model": args.model, "schedule": args.schedule, "stages": args.stages,
               "split": list(pipe.plan.split), "batch_size": args.batch_size,
               "microbatches": args.microbatches, **settings,
               "mitigation": args.mitigation or "none", "form": args.form,
               "horizon_scale": args.horizon_scale, "delays": pipe.schedule.delays,
               "replicas": args.replicas, "nodes": args.nodes,
               "rule": trainer.rule.name if trainer.rule else "none",
               "processes": jax.process_count()}
    if jax.process_index() > 0:
        return 0
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        _write_outputs(args.out, rows, summary, variables)
    print(f"\n{'test accuracy':<16}{100 * summary['test_accuracy']:.2f}%\n"
          f"{'train accuracy':<16}{100 * summary['train_accuracy']:.2f}%\n"
          f"{'steps':<16}{total} in {seconds:.0f} s ({summary['examples_per_s']:.0f} examples/s)\n"
          f"{'stages':<16}{args.stages} x {pipe.plan.split} layers, {args.schedule}, "
          f"{args.microbatches} micro-batches, mitigation {summary['mitigation']}"
          + (f"\n{'replicas':<16}{args.replicas}, rule {summary['rule']}" if args.replicas > 1
             else "")
          + (f", {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    return 0
