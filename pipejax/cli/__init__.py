"""`pipejax train`, `sample`, `plan` and `bench`: the library from the shell.

The CLI holds no logic the library lacks: it builds a layer list from
`pipejax.models`, calls `pj.pipeline`, and loops over `trainer.step`. When
there are fewer accelerators than stages, it runs on simulated CPU devices
and says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipejax.checks import REMATS
from pipejax.cli.config import PlanConfig, SampleConfig, TrainConfig, config
from pipejax.cli.plan import plan
from pipejax.cli.run import sample
from pipejax.cli.schedule_flag import schedule_name
from pipejax.cli.train import train
from pipejax.formatting import in_words
from pipejax.models import MODELS
from pipejax.schedules import FAMILIES, names
from pipejax.stage_layout import Gather
from pipejax.transforms.data_parallel import RULES
from pipejax.transforms.hyperparams import LR_SCHEDULES
from pipejax.transforms.mitigations import MITIGATIONS
from pipejax.transforms.muon import ON_MUON


def _count(text: str) -> int:
    """A flag that counts something: an int of 1 or more."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _rate(text: str) -> float:
    """A learning rate: a float above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def _common(q: argparse.ArgumentParser) -> None:
    """The flags of the pipeline `train` and `plan` build (config.Common)."""
    q.add_argument("--model", default="mlp", metavar="MODEL",
                   help=f"a model of the zoo ({', '.join(sorted(MODELS))}) or your own "
                        "function that returns the layer list, package.module:function (found "
                        "from the current directory; it gets vocab and context, or classes and "
                        "inputs, when it names them)")
    q.add_argument("--model-args", default=None, metavar="K=V,...",
                   help="the model's sizes, over its defaults: e.g. depth=4,width=64 "
                        "(arguments of pj.models.<model>, or of your function)")
    q.add_argument("--api", default="linen", choices=["linen", "nnx"],
                   help="the model's Flax API: linen modules or their NNX twins")
    q.add_argument("--data", default=None,
                   help="mnist1d (default) | digits | path to a .npz file; shakespeare "
                        "(the default of --model gpt) | package.module:function returning a "
                        "pj.data.Corpus or pj.data.Dataset")
    q.add_argument("--stages", type=_count, default=4)
    q.add_argument("--microbatches", type=_count, default=4)
    q.add_argument("--batch-size", type=_count, default=None,
                   help="examples (text windows) per step (default 128, gpt 32, or "
                        "--microbatch-size x --microbatches x --replicas)")
    q.add_argument("--microbatch-size", type=_count, default=None,
                   help="examples per micro-batch: the update size of an asynchronous "
                        "schedule (Kosson et al. train at 1); sets --batch-size")
    q.add_argument("--schedule", default="gpipe", type=schedule_name, metavar="NAME|CSV",
                   help=f"one of {', '.join(names())}, or a path to a table in torch's "
                        "CSV (torch.distributed.pipelining's _dump_csv), which brings its "
                        "own --virtual and --placement")
    on_v = [n for n, f in FAMILIES.items() if f.placement == "v"]
    defaults = sorted({f.virtual for f in FAMILIES.values()} - {1})
    q.add_argument("--virtual", type=_count, default=None, metavar="V",
                   help="model chunks per device (virtual stages; default 1, " + ", ".join(
                       f"{v} for {in_words([n for n, f in FAMILIES.items() if f.virtual == v])}"
                       for v in defaults) + "); with "
                        + ", ".join(n for n, f in FAMILIES.items() if f.virtuals != (1,)))
    q.add_argument("--placement", default=None, choices=["loop", "v"],
                   help="which chunks a device holds: loop (k, k + K, ...; default) or v "
                        f"(k and 2K − 1 − k; the default and only one of {', '.join(on_v)})")
    q.add_argument("--partition", default="variance",
                   help="variance | bottleneck | comma-separated layer counts, e.g. 3,2,2,2")
    q.add_argument("--remat", default="stage", choices=list(REMATS))
    q.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float16"],
                   help="the dtype the stages compute in (float32 master weights)")
    q.add_argument("--max-padding", type=float, default=None, metavar="F",
                   help="keep the packed parameters' padding within this fraction")
    q.add_argument("--replicas", type=_count, default=1,
                   help="pipeline replicas (data parallelism); --batch-size is split over them")
    q.add_argument("--nodes", type=_count, default=1,
                   help="groups of replicas, mesh (node, local, stage), for --rule hadpsgd")
    q.add_argument("--fsdp", type=_count, default=1, metavar="F",
                   help="devices each stage is sharded over (ZeRO-3): its weights, gradients "
                        "and optimizer state in F pieces, each micro-batch in F parts")
    q.add_argument("--fsdp-gather", default="tick", choices=[g.value for g in Gather],
                   help="where a stage sharded over --fsdp gathers its weights: at every tick "
                        "that uses them (the least memory) or once a step (synchronous "
                        "schedules)")
    q.add_argument("--tensor", type=_count, default=1, metavar="T",
                   help="devices each annotated parameter is split over (tensor parallelism; "
                        "the gpt carries Megatron's layout)")


def _train_flags(train: argparse.ArgumentParser) -> None:
    """`pipejax train`'s own flags (config.TrainConfig)."""
    train.add_argument("--optimizer", default=None,
                       choices=["sgd", "momentum", "adam", "adamw", "muon"],
                       help="default adam (gpt: adamw); momentum with --reference; muon: "
                            "optax.contrib.muon on the model's matrices, Adam on the rest, "
                            "its update's RMS AdamW's")
    train.add_argument("--weight-decay", type=float, default=0.1,
                       help="adamw's and muon's decoupled weight decay, on matrices and "
                            "embeddings (adamw runs with betas 0.9, 0.95)")
    train.add_argument("--lr", type=_rate, default=None, help="default: the model's")
    train.add_argument("--momentum", type=float, default=None,
                       help="--optimizer momentum's, with or without a mitigation (default 0.9)")
    train.add_argument("--mitigation", default=None, choices=list(MITIGATIONS),
                       help="staleness mitigation for --schedule " + " or ".join(
                           sorted(n for n, f in FAMILIES.items() if f.asynchronous)) + " "
                            "(on --optimizer adam or adamw: all but spectrain; nesterov on "
                            f"nothing else; on muon: {', '.join(ON_MUON)})")
    train.add_argument("--horizon-scale", type=float, default=1.0,
                       help="multiplies the forecast horizon and compensated delay (2: LWP_2D)")
    train.add_argument("--form", default=None, choices=["velocity", "difference"],
                       help="the forecast of lwp and lwp+sc (default: velocity on momentum, "
                            "difference on adam)")
    train.add_argument("--reference", default=None, metavar="LR,M,B",
                       help="scale a recipe tuned at batch B (learning rate LR, momentum M) to "
                            "this run's update size by Kosson et al.'s eq. 9; needs --optimizer "
                            "momentum (set by default with --reference)")
    train.add_argument("--lr-schedule", default=None, choices=list(LR_SCHEDULES),
                       help="step: x0.1 at each --decay-at fraction of training; cosine decay "
                            "(default constant; gpt: cosine)")
    train.add_argument("--decay-at", default="0.5,0.75", metavar="F,F",
                       help="fractions of training where --lr-schedule step divides the rate by 10")
    train.add_argument("--warmup", type=int, default=None, metavar="N",
                       help="updates of linear learning-rate warm-up (with --mitigation pipemare: "
                            "PipeMare's K_warm instead, default one epoch; gpt: 100, at most a "
                            "tenth of the run)")
    train.add_argument("--rule", default=None, choices=list(RULES),
                       help="how replicas combine: ssgd (default), adpsgd, hadpsgd, elastic")
    train.add_argument("--alpha", type=float, default=0.1, help="elastic moving rate")
    train.add_argument("--every", type=_count, default=8, help="steps between elastic averagings")
    train.add_argument("--processes", type=_count, default=1,
                       help="run as N local processes forming one mesh (jax.distributed, gloo); "
                            "on several hosts set PIPEJAX_COORDINATOR, PIPEJAX_PROCESSES, "
                            "PIPEJAX_PROCESS_ID on each instead")
    train.add_argument("--epochs", type=_count, default=None, help="default: the model's")
    train.add_argument("--steps", type=_count, default=None, help="overrides --epochs")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-every", type=int, default=None,
                       help="steps between evaluations: test accuracy, or a language model's "
                            "validation loss (default none; gpt: 250)")
    train.add_argument("--eval-windows", type=int, default=256, metavar="N",
                       help="a language model's evaluations during training read N validation "
                            "windows spread over the text; the final one reads them all")
    train.add_argument("--out", type=Path, default=None,
                       help="write report.html (one self-contained page: curves, schedule, plan, "
                            "memory, settings; a language model's sample), metrics.jsonl, "
                            "metrics.csv, curve.png, schedule.png, params.msgpack, the final "
                            "checkpoint and run.json (for pipejax sample) here")
    train.add_argument("--prompt", default="\n", help="a language model's sample starts here")
    train.add_argument("--sample-length", type=int, default=600, metavar="N",
                       help="bytes of the sample a language model writes into the report")
    train.add_argument("--temperature", type=float, default=0.8,
                       help="of the report's sample (0: the most likely byte each time)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--resume", type=Path, default=None, metavar="DIR",
                       help="a checkpoint directory, or a run's --out directory (its "
                            "checkpoint/): continue from its latest checkpoint if it holds one "
                            "(any --stages for a synchronous schedule), and save there")
    train.add_argument("--save-every", type=int, default=0, metavar="N",
                       help="steps between checkpoints in --resume DIR (also saved at the end)")
    train.add_argument("--clip", type=float, default=None,
                       help="clip the gradients by their global norm over all stages")
    train.add_argument("--skip-nonfinite", action="store_true",
                       help="skip (and count) updates whose loss or gradients are not finite")


def _sample_flags(text: argparse.ArgumentParser) -> None:
    """`pipejax sample`'s flags (config.SampleConfig)."""
    text.add_argument("--from", dest="from_", type=Path, required=True, metavar="DIR",
                      help="the --out directory of a `pipejax train --model gpt` run")
    text.add_argument("--prompt", default="\n", help="the text to continue")
    text.add_argument("--length", type=int, default=500, help="bytes to generate")
    text.add_argument("--temperature", type=float, default=0.8,
                      help="divides the logits; 0 takes the most likely byte each time")
    text.add_argument("--top-k", type=int, default=None, help="draw among the k most likely bytes")
    text.add_argument("--seed", type=int, default=0)


def _plan_flags(plan: argparse.ArgumentParser) -> None:
    """`pipejax plan`'s own flags (config.PlanConfig)."""
    plan.add_argument("--plot", type=Path, default=None, help="also draw the timeline to this PNG")
    plan.add_argument("--search", action="store_true",
                      help="rank the configurations of --devices for --batch-size (pj.search): "
                           "predicted step time, memory per device, bubble, the delay in "
                           "effective steps")
    plan.add_argument("--devices", type=_count, default=8,
                      help="with --search: data x stages x --fsdp x --tensor")
    plan.add_argument("--schedules", default=None, metavar="NAME,...",
                      help="with --search: the schedules to rank (default "
                           + ",".join(n for n, f in FAMILIES.items() if f.searched) + ")")
    plan.add_argument("--memory", default=None, metavar="BYTES",
                      help="with --search: leave out candidates above this per device (16GiB, "
                           "512MiB or a number)")
    plan.add_argument("--reference", default=None, metavar="LR,M,B",
                      help="with --search: the synchronous recipe an asynchronous candidate "
                           "moves to its micro-batch by eq. 9 (Kosson et al.)")
    plan.add_argument("--lr", type=_rate, default=None,
                      help="with --search: the asynchronous update's own rate (with --momentum)")
    plan.add_argument("--momentum", type=float, default=0.0,
                      help="with --search and --lr: the update's momentum")
    plan.add_argument("--machine", default=None,
                      metavar="FLOPS,BYTES/S,SECONDS[,HOST[,MEMORY[,LAYER]]] | JSON | host",
                      help="with --search: a device's FLOP/s, the link's bytes/s, a tick's fixed "
                           "seconds, for devices sharing one processor (simulated CPU "
                           "devices) its FLOP/s (0: none shared), the bytes/s of a device's "
                           "memory, and a layer's forward's fixed seconds (0: none counted; "
                           "default 50e12,50e9,20e-6,0,2e12,0: a GPU); or the bench_gpu.json "
                           "of `make gpu`, for the device rate it measured; or host: this "
                           "machine's --devices simulated devices, every rate measured (a "
                           "minute or two)")
    plan.add_argument("--pick", type=int, default=None, metavar="N",
                      help="with --search: build candidate N and print its plan and schedule")


# Each command that the parser reads: its config and what runs it (`bench` parses its own).
COMMANDS = {"train": (TrainConfig, train), "plan": (PlanConfig, plan),
            "sample": (SampleConfig, sample)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipejax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model with a pipelined step")
    _common(train)
    _train_flags(train)
    text = sub.add_parser("sample", help="print text from the language model of a saved run")
    _sample_flags(text)
    sub.add_parser("bench", add_help=False,
                   help="measure overhead, bubbles, memory, compile time, padding (and on a GPU, "
                        "MFU); `pipejax bench --help` for its options")
    plan = sub.add_parser("plan", help="print the partition table and the schedule timeline")
    _common(plan)
    _plan_flags(plan)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        import pipejax as pj
        from pipejax import bench

        try:
            pj.simulate_devices(32)  # the deepest compile-time case runs 32 stages
        except pj.errors.DeviceError:
            pass  # JAX already started (bench called in-process): fewer stages there
        return bench.main(argv[1:])
    args = _parser().parse_args(argv)
    from pipejax import distributed
    from pipejax.errors import PipejaxError

    try:
        kind, run = COMMANDS[args.command]
        cfg = config(args, kind)
        if getattr(cfg, "processes", 1) > 1 and not distributed.launched():
            devices = cfg.replicas * cfg.stages * cfg.fsdp * cfg.tensor
            local = distributed.devices_per_process(devices, cfg.processes)
            return distributed.launch([sys.executable, "-m", "pipejax", *argv], cfg.processes,
                                      local, timeout=24 * 3600)
        if distributed.launched():
            distributed.initialize()
        return run(cfg)
    except PipejaxError as err:
        print(f"pipejax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
