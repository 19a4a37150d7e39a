"""`pipejax train`: train a model with a pipelined step; metrics, curve,
parameters and a report out.

Before the first step it prints the predicted memory per device and the
time `trainer.step` takes to compile; a later step that compiles again
(jax.monitoring's XLA compile event) is announced with what changed.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax

from pipejax.cli.report import write_report
from pipejax.cli.run import save_run
from pipejax.cli.schedule_flag import synchronous as is_synchronous
from pipejax.cli.setup import (apply_model_defaults,
                              describe_optimizer, make_optimizer, make_pipeline, model_kwargs,
                              model_lr,
                              resolve_batch_size, setup_devices)
from pipejax.cli.tasks import load_task
from pipejax.schedules import plot

XLA_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event, in seconds


def _signature(tree: Any) -> list[tuple[str, str]]:
    """(path, "dtype[shape] sharding") of every array of `tree`: what jit's cache keys on."""
    return [(jax.tree_util.keystr(path), f"{a.dtype}[{','.join(map(str, a.shape))}]"
             + (f" {a.sharding.spec}" if hasattr(getattr(a, "sharding", None), "spec") else ""))
            for path, a in jax.tree_util.tree_leaves_with_path(tree)]


def _change(name: str, now: list[tuple[str, str]], first: list[tuple[str, str]]) -> str | None:
    """The first array of `now` that differs from `first`, named, or None."""
    if len(now) != len(first):
        return f"the {name} holds {len(now)} arrays, at the first step {len(first)}"
    return next((f"the {name}{p} is {a}, at the first step {b}"
                 for (p, a), (_, b) in zip(now, first) if a != b), None)


def _compiling(call: Callable[[], Any]) -> tuple[Any, list[float]]:
    """`call()`, and the seconds of each XLA compilation it ran (jax.monitoring's events)."""
    seconds: list[float] = []

    def listen(event: str, duration: float, **_) -> None:
        if event == XLA_COMPILE:
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        return call(), seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class StepCompiles:
    """`trainer.step`, its compilations told: the first made ahead of the
    first step and timed (trace, lower, XLA compile), any later one (an XLA
    compilation during a step) announced by `say` with the argument that
    changed since the first step."""

    def __init__(self, trainer, say: Callable[[str], Any]):
        self.trainer, self.say = trainer, say
        self.seconds: float | None = None  # the first compilation's; None before the first step
        self._first: tuple = ()  # the signatures of the first step's batch and state

    def __call__(self, state, batch, step: int) -> tuple:
        """`trainer.step(state, batch)` as the run's `step`-th step."""
        if self.seconds is None:
            start = time.perf_counter()
            self.trainer.step.lower(state, batch).compile()
            self.seconds = time.perf_counter() - start
            self._first = _signature(batch), _signature(state)
            self.say(f"trainer.step compiled in {self.seconds:.1f} s")
        out, seconds = _compiling(lambda: self.trainer.step(state, batch))
        if seconds:
            why = (_change("batch", _signature(batch), self._first[0])
                   or _change("state", _signature(state), self._first[1])
                   or "the batch and state are shaped and placed as at the first step")
            self.say(f"step {step} recompiled trainer.step in {sum(seconds):.1f} s: {why}")
        return out


def _write_outputs(out: Path, rows: list[dict], summary: dict, variables, metric: str) -> None:
    """metrics.jsonl (last line: the summary), metrics.csv, curve.png (the
    train loss and the task's `metric`), params.msgpack."""
    import flax.serialization
    import matplotlib
    from flax import nnx

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
    evals = [r for r in rows if metric in r]
    label = metric.replace("_", " ")
    if evals and metric == "validation_loss":  # one axis: both are nats per token
        ax.plot([r["step"] for r in evals], [r[metric] for r in evals], "o-", label=label)
        ax.legend()
    elif evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r[metric] for r in evals], "o-",
                 color="tab:orange", label=label)
        ax2.set_ylabel(label)
    ax.set_xlabel("step"), ax.set_ylabel("loss")
    if all(r["loss"] > 0 for r in rows if "loss" in r):
        ax.set_yscale("log")
    final = summary[metric]
    ax.set_title(f"{label} {100 * final:.2f}%" if metric == "test_accuracy" else
                 f"{label} {final:.4f} ({summary['bits_per_byte']:.4f} bits per byte)")
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)
    plt.close(fig)
    pure = lambda v: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v  # NNX layers' States
    (out / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(
        {str(i): pure(v) for i, v in enumerate(variables)}))


def _loop(args, trainer, state, task, total: int):
    """Steps `state.step` to `total` over the task's batches (a resumed run
    goes on with the batch it would have had next), then a flush; returns the
    state, the metric rows, the seconds it took and those of the first
    compilation (None if no step ran)."""
    import pipejax as pj
    from tqdm import tqdm

    rows: list[dict] = []
    step, start = int(state.step), time.perf_counter()
    first = step
    bar = tqdm(total=total, initial=step, unit="step", disable=args.quiet, dynamic_ncols=True)
    step_once = StepCompiles(trainer, bar.write if jax.process_index() == 0 else lambda _: None)
    rate_name = "ex_per_s" if task.unit == "examples" else "tok_per_s"
    batches = task.batches(args.batch_size, step)
    while step < total:
        epoch, batch = next(batches)
        state, metrics = step_once(state, batch, step + 1)
        step += 1
        if args.save_every and step % args.save_every == 0:
            pj.save(args.resume, trainer, state)
        if (step % 20 == 0 or step == total) and int(metrics["completed"]):
            loss = float(metrics["loss"])
            rate = (step - first) * task.items(args.batch_size) / (time.perf_counter() - start)
            bar.set_postfix({"loss": f"{loss:.4f}", rate_name: f"{rate:.0f}"})
            rows.append({"step": step, "epoch": epoch, "loss": loss})
            if "skipped" in metrics:
                rows[-1]["skipped"] = int(metrics["skipped"])
            if "consensus_distance" in metrics:
                rows[-1]["consensus_distance"] = float(metrics["consensus_distance"])
        if args.eval_every and step % args.eval_every == 0:
            result = task.evaluate(pj.unstage(state))
            rows.append({"step": step, "epoch": epoch, **result})
            bar.write(f"step {step}: {task.describe(result)}")
        bar.update(1)
    bar.close()
    state, _ = trainer.flush(state)  # an asynchronous pipeline finishes what is in flight
    if args.resume is not None:
        pj.save(args.resume, trainer, state)
    return state, rows, time.perf_counter() - start, step_once.seconds


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

    defaulted = apply_model_defaults(args)
    args.batch_size = resolve_batch_size(args)
    args.optimizer = args.optimizer or ("momentum" if args.reference else "adam")
    mesh = setup_devices(args.stages, args.replicas, args.nodes)
    task = load_task(args.model, args.data, model_kwargs(args.model, args.model_args).get("context"),
                     args.eval_windows, args.seed)
    if args.batch_size % (args.microbatches * args.replicas):
        raise pj.errors.ConfigError(f"--batch-size {args.batch_size} is not divisible by "
                                    f"--microbatches {args.microbatches} x --replicas "
                                    f"{args.replicas}")
    if args.save_every and args.resume is None:
        raise pj.errors.ConfigError("--save-every N writes checkpoints into --resume DIR; give "
                                    "the directory")
    if task.unit == "tokens" and (not args.prompt or args.sample_length < 0
                                  or args.temperature < 0 or args.eval_windows < 1):
        raise pj.errors.ConfigError(
            f"--prompt {args.prompt!r} --sample-length {args.sample_length} --temperature "
            f"{args.temperature} --eval-windows {args.eval_windows}: the report's sample needs a "
            "prompt of one byte or more, a length and temperature of 0 or more, and the "
            "evaluations 1 window or more")
    save_dir = args.out  # every process takes part in saving the checkpoint
    if jax.process_index() > 0:  # one process reports for the job
        args.quiet, args.out, args.eval_every = True, None, 0
    per_epoch = task.steps_per_epoch(args.batch_size)
    total = args.steps if args.steps is not None else args.epochs * per_epoch
    if "warmup" in defaulted:  # a model's warm-up takes at most a tenth of a short run
        args.warmup = min(args.warmup, total // 10)
    synchronous = is_synchronous(args)
    per_step = 1 if synchronous else args.microbatches  # a stage's updates per step
    optimizer, stash, settings = make_optimizer(
        args, model_lr(args), (total * per_step, per_epoch * per_step),
        args.batch_size // (1 if synchronous else args.microbatches), synchronous)
    layers, pipe = make_pipeline(args, task, mesh, stash)
    trainer = pipe.trainer(optimizer, _rule(args), clip_norm=args.clip,
                           skip_nonfinite=args.skip_nonfinite)
    memory = str(trainer.memory())
    if jax.process_index() == 0:
        print(pipe, flush=True)
        print(f"optimizer: {describe_optimizer(settings)}", flush=True)
        print(memory, flush=True)
    if args.resume is not None and pj.checkpoint.latest(args.resume) is not None:
        state = pj.restore(args.resume, trainer)
        if jax.process_index() == 0:
            print(f"resumed from step {int(state.step)} in {args.resume}", flush=True)
    else:
        state = trainer.init(pipe.init(jax.random.key(args.seed)), jax.random.key(args.seed + 1))
    task.bind(layers)
    first = int(state.step)
    state, rows, seconds, compile_seconds = _loop(args, trainer, state, task, total)
    variables = pj.unstage(state)  # gathered from every process; the replicas' mean
    rate = round((total - first) * task.items(args.batch_size) / seconds, 1)
    summary = {**task.evaluate(variables, final=True),
               "steps": total, "epochs": round(total / per_epoch, 2),
               "seconds": round(seconds, 1),
               "compile_seconds": None if compile_seconds is None else round(compile_seconds, 2),
               f"{task.unit}_per_s": rate,
               "model": args.model, "api": args.api, "data": args.data,
               "schedule": args.schedule, "stages": args.stages,
               "split": list(pipe.plan.split), "virtual": pipe.plan.placement.virtual,
               "batch_size": args.batch_size,
               "microbatches": args.microbatches, **settings,
               "mitigation": args.mitigation or "none", "form": args.form,
               "horizon_scale": args.horizon_scale, "delays": pipe.schedule.delays,
               "replicas": args.replicas, "nodes": args.nodes,
               "rule": trainer.rule.name if trainer.rule else "none",
               "processes": jax.process_count()}
    if save_dir:
        save_run(save_dir, args, trainer, state)
    if jax.process_index() > 0:
        return 0
    sample = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        _write_outputs(args.out, rows, summary, variables, task.metric)
        plot(pipe.schedule, str(args.out / "schedule.png"))
        flags = {k: v for k, v in vars(args).items() if k != "command"}
        if task.unit == "tokens":
            sample = task.sample(layers, variables, args)
            (args.out / "sample.txt").write_text(sample, encoding="utf-8")
        write_report(args.out, summary, flags, str(pipe), memory, task.describe(summary), sample)
    unit = "tokens/s" if task.unit == "tokens" else "examples/s"
    chunks = pipe.plan.placement.virtual
    lines = task.lines(summary) + [
        ("steps", f"{total} in {seconds:.0f} s ({rate:.0f} {unit})"),
        ("stages", f"{args.stages} x {pipe.plan.split} layers"
                   f"{f' in {chunks} chunks a device' if chunks > 1 else ''}, "
                   f"{args.schedule}, {args.microbatches} micro-batches, mitigation "
                   f"{summary['mitigation']}")]
    if args.replicas > 1:
        lines.append(("replicas", f"{args.replicas}, rule {summary['rule']}"
                      + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")))
    if args.out:
        lines.append(("report", str(args.out / "report.html")))
    print("\n" + "\n".join(f"{name:<16}{value}" for name, value in lines))
    if sample is not None:
        print(f"\nsample (temperature {args.temperature}):\n{sample}")
    return 0
