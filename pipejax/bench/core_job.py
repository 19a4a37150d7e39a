"""Inside the cores benchmark's job (bench/cores.py): one of the K pinned
processes, which times every row's step, its ops alone and the plain jit,
or with `--plain` the plain jit alone in a process of its own. Run by
`cores.measure` as `python -m pipejax.bench.core_job`."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from pipejax.bench.core_models import Model, models, plain, trainer
from pipejax.bench.cores import row_key


def _barrier() -> Callable[[], None]:
    """A call every process of the job passes together: a psum of one
    number over every device, compiled once (with `sync_global_devices`,
    which builds its array anew each call, the plain jit's row in the job
    took 1118 ms on the GPT at M = 8 against 660 alone)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("all",))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "all"), mesh=mesh,
                                  in_specs=P("all"), out_specs=P()))
    ones = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                                  np.ones(jax.local_device_count(), np.float32))
    return lambda: jax.block_until_ready(total(ones))


def _job(model: Model, rows: list[dict], repeats: int, folder: Path) -> None:
    """Inside the K-process job: every row's step, every op of its table
    alone and the plain jit (on process 0) alternated, then each row's
    profile; process 0 writes the rows' figures to `folder`/job.json."""
    import jax
    from pipejax.bench.collective_time import collective_share
    from pipejax.planner.paths import coupled_path, earliest_path
    from pipejax.bench.op_times import ideal_seconds, op_runs
    from pipejax.timing import alternate

    me, barrier = jax.process_index(), _barrier()
    step = plain(model, rows[0]["M"], jax.local_devices()[0]) if me == 0 else None

    def plain_in_job():
        if step is not None:
            step()
        barrier()
    built = {row_key(row): trainer(model, row) for row in rows}
    # The barrier before the plain jit: each process ends a round with its
    # own ops, so without it process 0's plain jit waited for process 1's
    # last ops (the GPT at M = 4 took 738 ms in the job against 318 alone).
    runs = {"sync": barrier, "plain": plain_in_job,
            **{name: run for name, (_, run) in built.items()}}
    for name, (pipe, _) in built.items():
        runs.update({f"{name}|{op}": run for op, run in op_runs(pipe, model.optimizer()).items()})
    samples = alternate(runs, repeats)
    times = {name: float(np.median(t)) for name, t in samples.items()}
    least = {name: float(np.min(t)) for name, t in samples.items()}
    shares = {name: collective_share(run, barrier) for name, (_, run) in built.items()}
    (folder / f"process{me}.json").write_text(json.dumps({"times": times, "least": least,
                                                           "shares": shares}))
    barrier()  # every process's file is written
    if me:
        return
    every = [json.loads((folder / f"process{k}.json").read_text())
             for k in range(jax.process_count())]
    out = {"plain": times["plain"]}
    for name, (pipe, _) in built.items():
        ops = {op.split("|")[1]: s for process in every for op, s in process["least"].items()
               if op.startswith(f"{name}|")}
        step = times[name]
        waiting = [round(1e3 * step * p["shares"][name], 1) for p in every]
        out[name] = {"seconds": step, "least": least[name], "ideal": ideal_seconds(pipe, ops),
                     "lockstep": ideal_seconds(pipe, ops, partial(earliest_path, lockstep=True)),
                     "coupled": ideal_seconds(pipe, ops, coupled_path), "ops": ops,
                     "ticks": pipe.schedule.ticks, "collective_ms": waiting,
                     "busy_ms": [round(1e3 * step - w, 1) for w in waiting]}
    (folder / "job.json").write_text(json.dumps(out))


def worker(argv: list[str]) -> int:
    """One process of a job, or with `--plain` the plain jit alone."""
    p = argparse.ArgumentParser()
    p.add_argument("--rows", required=True)
    p.add_argument("--folder", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--plain", action="store_true")
    args = p.parse_args(argv)
    rows = json.loads(args.rows)
    model = models()[rows[0]["model"]]
    from pipejax import distributed

    if args.plain:
        distributed.pin()
        import jax

        from pipejax.timing import alternate

        seconds = alternate({"plain": plain(model, rows[0]["M"], jax.devices()[0])},
                            args.repeats)["plain"]
        (args.folder / "plain.json").write_text(json.dumps([float(np.median(seconds)),
                                                            float(np.min(seconds))]))
        return 0
    distributed.initialize()
    _job(model, rows, args.repeats, args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
