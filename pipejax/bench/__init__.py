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
  gpu        (on a GPU) the zoo GPT at GPT-2 small's size, bf16 and float32,
             over bytes and (bf16) over GPT-2's vocabulary padded to 50304:
             plain jit against the pipelined step at K = 1 (and K = 2, 4, 8
             where the devices are): step time, tokens/s, model FLOP
             utilisation against the dtype's dense peak, bytes accessed,
             peak memory, compile time (bench/gpu.py); `--smoke` runs it
             on a tiny GPT on any backend, and writes its JSON to the
             temporary directory unless `--out` is given.
  cores      (only with `--only cores`) every registered family at K = 2
             stages in 2 processes, each pinned to its own core, against the
             plain jit alone on one pinned core (bench/cores.py): step time,
             speed-up where an idle tick costs time, the table's ideal step
             from its ops timed alone, each process's busy and collective
             time; `--models` and `--microbatches` choose the jobs (one job,
             under 10 minutes, per model and M), rows already in the JSON
             are kept.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import optax

import pipejax as pj
from pipejax import formatting
from pipejax.bench.bubbles import bubbles
from pipejax.bench.compile_time import compile_times
from pipejax.bench.core_models import models
from pipejax.bench.cores import cores as cores_section  # the submodule keeps its name
from pipejax.bench.gpu import BUDGET, gpu
from pipejax.bench.memory import memory, padding, peak_bytes
from pipejax.bench.plot import plot
from pipejax.bench.speed import overhead, step_times

__all__ = ["environment", "main", "peak_bytes", "step_times", "table"]


def environment(command: str) -> dict:
    """The machine, the versions, the command and the date, for a results JSON
    ("cpus": the cores this process may run on)."""
    import flax
    import jaxlib

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": platform.machine(), "processor": platform.processor(),
            "cpus": cpus, "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "pipejax": pj.__version__, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "devices": len(jax.devices()),
            "driver": driver(), "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def driver() -> str | None:
    """The NVIDIA driver's version, if `nvidia-smi` answers."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.split("\n")[0].strip() or None) if out.returncode == 0 else None


def table(rows: list[dict]) -> str:
    """Rows as aligned text columns under a header of every row's keys."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
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
                        choices=["overhead", "bubbles", "memory", "compile", "padding", "gpu",
                                 "cores"])
    parser.add_argument("--smoke", action="store_true",
                        help="the gpu section alone, on a tiny GPT, on any backend (a test runs "
                             "it)")
    parser.add_argument("--budget", type=float, default=BUDGET,
                        help="the wall time the gpu section aims at, in seconds, compiles "
                             "included: it compiles no row in the last fifth of each dtype's "
                             "share, stops timing at its end, and keeps what it measured")
    parser.add_argument("--models", nargs="*", default=["gpt"], choices=list(models()),
                        help="the cores section's models")
    parser.add_argument("--microbatches", nargs="*", type=int, default=[8],
                        help="the cores section's micro-batch counts M")
    return parser


def _section(out: Path, name: str) -> list:
    """The rows of section `name` in the JSON at `out`, if any."""
    return json.loads(out.read_text()).get(name, []) if out.exists() else []


def _write_section(out: Path, name: str, rows: list, run: dict) -> None:
    """Section `name` of the JSON at `out` replaced by `rows` now (a long
    section saves as it goes), its environment under "rerun"."""
    old = json.loads(out.read_text()) if out.exists() else {"environment": run}
    old[name], old["rerun"] = rows, {**old.get("rerun", {}), name: run}
    out.write_text(json.dumps(old, indent=2))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    sections = {"overhead": lambda: overhead(args.repeats), "bubbles": bubbles,
                "memory": memory, "compile": compile_times, "padding": padding}
    if jax.default_backend() == "gpu" or args.smoke:
        sections["gpu"] = lambda: gpu(args.smoke, args.budget)
    chosen = ["gpu"] if args.smoke else args.only or list(sections)
    repo = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    folder = (Path(tempfile.gettempdir()) if args.smoke else repo if repo.is_dir() else Path("."))
    out = args.out or folder / f"bench_{'gpu_smoke' if args.smoke else jax.default_backend()}.json"
    run = environment(" ".join(["pipejax bench", *argv]))
    sections["cores"] = lambda: cores_section(  # minutes of processes: asked for alone
        args.repeats, tuple(args.models), tuple(args.microbatches),
        _section(out, "cores"), lambda rows: _write_section(out, "cores", rows, run))
    if "gpu" in chosen and "gpu" not in sections:
        print(f"pipejax bench: the gpu section needs a GPU and JAX sees {jax.default_backend()} "
              f"devices; add --smoke to run it on a tiny GPT here", file=sys.stderr)
        return 2
    results, start = {}, time.perf_counter()
    for name in chosen:
        began = time.perf_counter()
        results[name] = sections[name]()
        print(f"\n== {name} ({time.perf_counter() - began:.0f} s)")
        parts = results[name] if isinstance(results[name], dict) else {name: results[name]}
        parts = {p: rows for p, rows in parts.items() if isinstance(rows, list) and rows}
        for part, rows in parts.items():
            if len(parts) > 1:
                print(f"-- {part}")
            print(table(rows))
    seconds = results["seconds"] = round(time.perf_counter() - start, 1)
    if args.only and out.exists():  # the other sections stay as their last full run wrote them
        old = json.loads(out.read_text())
        rerun = {**old.get("rerun", {}), **{name: run for name in chosen}}
        results = {**old, **{n: results[n] for n in chosen}, "rerun": rerun}  # "seconds": the full run's
    else:
        results["environment"] = run
    out.write_text(json.dumps(results, indent=2))
    drawn = plot(results, out.with_suffix(".png"))
    print(f"\n{seconds:.0f} s in all; wrote {out}"
          + (f" and {out.with_suffix('.png').name}" if drawn else ""))
    return 0
