"""What `pipejax train` leaves in --out and prints when it finishes:
metrics, curve, parameters, the report page (report.py) and the summary
lines."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax

from pipejax.cli.config import TrainConfig
from pipejax.cli.report import write_report
from pipejax.schedules import plot


def write_outputs(out: Path, rows: list[dict], summary: dict, variables, metric: str) -> None:
    """metrics.jsonl (last line: the summary), metrics.csv, curve.png (the
    train loss and the task's `metric`), params.msgpack."""
    import flax.serialization
    import matplotlib
    from flax import nnx
    from flax.core import meta

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
    # NNX layers' States as dicts; linen's annotated leaves without their boxes
    pure = lambda v: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else meta.unbox(v)
    (out / "params.msgpack").write_bytes(flax.serialization.msgpack_serialize(
        {str(i): pure(v) for i, v in enumerate(variables)}))


class Run(NamedTuple):
    """A finished training run, as `finish` reports it."""

    pipe: Any
    task: Any
    layers: list
    variables: list  # one per layer, as pj.unstage gives them
    rows: list[dict]  # the metrics, a row per logged step and evaluation
    summary: dict
    memory: str  # trainer.memory(), as printed
    seconds: float  # the training loop's


def finish(cfg: TrainConfig, run: Run) -> None:
    """The files of --out (report.html and the rest) and the run's summary, printed."""
    pipe, task, layers, variables, rows, summary, memory, seconds = run
    sample = None
    if cfg.out:
        cfg.out.mkdir(parents=True, exist_ok=True)
        write_outputs(cfg.out, rows, summary, variables, task.metric)
        plot(pipe.schedule, str(cfg.out / "schedule.png"))
        if task.unit == "tokens":
            sample = task.sample(layers, variables, cfg.prompt, cfg.sample_length, cfg.seed,
                                 cfg.temperature)
            (cfg.out / "sample.txt").write_text(sample, encoding="utf-8")
        write_report(cfg.out, summary, cfg.flags(), str(pipe), memory, task.describe(summary),
                     sample)
    unit = "tokens/s" if task.unit == "tokens" else "examples/s"
    chunks = pipe.plan.placement.virtual
    rate = summary[f"{task.unit}_per_s"]
    lines = task.lines(summary) + [
        ("steps", f"{summary['steps']} in {seconds:.0f} s ({rate:.0f} {unit})"),
        ("stages", f"{cfg.stages} x {pipe.plan.split} layers"
                   f"{f' in {chunks} chunks a device' if chunks > 1 else ''}, "
                   f"{cfg.schedule}, {cfg.microbatches} micro-batches, mitigation "
                   f"{summary['mitigation']}")]
    if cfg.replicas > 1:
        lines.append(("replicas", f"{cfg.replicas}, rule {summary['rule']}"
                      + (f", {jax.process_count()} processes" if jax.process_count() > 1 else "")))
    if cfg.fsdp > 1:
        lines.append(("fsdp", f"{cfg.fsdp} devices a stage, weights gathered once a "
                               f"{pipe.build.stage.gather.value}"))
    if cfg.tensor > 1:
        lines.append(("tensor", f"{cfg.tensor} devices split each annotated parameter"))
    if cfg.out:
        lines.append(("report", str(cfg.out / "report.html")))
    print("\n" + "\n".join(f"{name:<16}{value}" for name, value in lines))
    if sample is not None:
        print(f"\nsample (temperature {cfg.temperature}):\n{sample}")
