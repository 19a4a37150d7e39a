"""`pipejax bench`: the measurements behind the documentation's claims, in one run.

Sections (each a table, all in one JSON with the machine and versions):
  overhead   1-stage pipelined step over a plain `jax.jit` of the same model
             and optimizer (micro-batched by a `lax.scan`, and whole-batch):
             step time and XLA's bytes accessed, an MLP and a Transformer;
  bubbles    idle share of each schedule's table over n steps (and the
             flush) against the closed form;
  memory     compiled peak bytes of one device (`memory_analysis()`:
             argument + output + temp; SPMD buffers are padded to the largest
             stage, so this is the heaviest stage) per schedule and remat
             mode, against `trainer.memory()`'s prediction;
  compile    compile time of the training step against micro-batches,
             stages, and depth (shared branches against one per stage);
  padding    padded over real bytes of the packed parameter buffers and the
             largest stage's cost, the least padding any split reaches, and
             the split `max_padding` picks at that bound;
  gpu        (on a GPU) a Transformer of 8 blocks, width 1024, at K = 1:
             step time, examples/s and model FLOP utilisation (model FLOPs:
             forward + backward of every layer; peak: the device's dense
             TF32 rate), pipelined and plain jit.
Stages beyond the default backend's devices run on simulated CPU devices.
Ratios are measured in one run (alternating calls), never across runs.
`--only` runs some sections and replaces them in an existing JSON (the
environment of each rerun under "rerun").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import optax

import pipejax as pj
from pipejax import formatting
from pipejax.bench.bubbles import bubbles
from pipejax.bench.compile_time import compile_times
from pipejax.bench.memory import memory, padding, peak_bytes
from pipejax.bench.plot import plot
from pipejax.bench.speed import gpu, overhead, step_times

__all__ = ["environment", "main", "peak_bytes", "step_times", "table"]


def environment(command: str) -> dict:
    """The machine, the versions, the command and the date, for a results JSON."""
    import flax

    return {"machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "pipejax": pj.__version__,
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "devices": len(jax.devices()), "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(rows: list[dict]) -> str:
    """Rows of equal keys as aligned text columns under a header."""
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    return formatting.table([keys, *cells], rstrip=False)


def parser() -> argparse.ArgumentParser:
    """`pipejax bench`'s arguments."""
    parser = argparse.ArgumentParser(prog="pipejax bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/bench_<backend>.json "
                             "when run from the repository, else ./bench_<backend>.json)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per comparison")
    parser.add_argument("--only", nargs="*", default=None,
                        choices=["overhead", "bubbles", "memory", "compile", "padding", "gpu"])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    sections = {"overhead": lambda: overhead(args.repeats), "bubbles": bubbles,
                "memory": memory, "compile": compile_times, "padding": padding}
    if jax.default_backend() == "gpu":
        sections["gpu"] = lambda: gpu(args.repeats)
    chosen = args.only or list(sections)
    results, start = {}, time.perf_counter()
    for name in chosen:
        began = time.perf_counter()
        results[name] = sections[name]()
        print(f"\n== {name} ({time.perf_counter() - began:.0f} s)")
        parts = results[name] if isinstance(results[name], dict) else {name: results[name]}
        for part, rows in parts.items():
            if len(parts) > 1:
                print(f"-- {part}")
            print(table(rows))
    seconds = results["seconds"] = round(time.perf_counter() - start, 1)
    repo = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    out = args.out or (repo if repo.is_dir() else Path(".")) / f"bench_{jax.default_backend()}.json"
    run = environment(" ".join(["pipejax bench", *argv]))
    if args.only and out.exists():  # the other sections stay as their last full run wrote them
        old = json.loads(out.read_text())
        rerun = {**old.get("rerun", {}), **{name: run for name in chosen}}
        results = {**old, **{n: results[n] for n in chosen}, "rerun": rerun}  # "seconds": the full run's
    else:
        results["environment"] = run
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"\n{seconds:.0f} s in all; wrote {out} and {out.with_suffix('.png').name}")
    return 0
