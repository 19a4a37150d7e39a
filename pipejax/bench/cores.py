"""Schedules on real cores: K stages in K processes, each pinned to its own
core with XLA:CPU on one thread, gloo between them (`distributed.launch`
with `pinned`). There an idle tick is an idle core, as on GPUs, and a
message crosses a process boundary; simulated devices in one process share
the cores, so a schedule's bubble costs them nothing.

Each row is one table (family, remat) at K stages and M micro-batches of a
model (`core_models.models`), timed in one K-process job (`core_job`)
with every row's step and the plain jit called in turn
(`speed.alternate`), medians. The plain jit of the
same micro-batches (`plain_microbatched`: the gradients of M micro-batches
summed, one update) is timed twice more alone on one pinned core, in a
process of its own before and after the job (a pinned process cannot share
the job's cores without changing what it measures); the speed-up is the
faster of those two over the row. Inside the job it runs on process 0 while
the others wait in a collective, which takes no processor time
(`collective_time`), and is reported beside.

Per row the job also measures the table's ideal step (`op_times`: each op
alone on its device, alternated with the steps, laid on the table as early
as its inputs allow, in lock step, and as the executor's collectives
couple the devices, `pipejax.planner.paths.coupled_path`) and, from a profile of the
row's step, each process's share of it in collectives (idle for a peer,
and the link; `collective_time`), given in milliseconds of the median
step, and the rest, busy.

This machine's neighbours make a call's time drift by a quarter (the plain
jit alone: 350 ms before a job, 439 ms after it; an op's median over its
fastest call: 1.3): medians give the speed-ups a user meets, the fastest
calls (`least_*`) what the code costs. The ideal step is built from each
op's fastest call, so `of_ideal` is the ideal over the row's fastest step,
and `ideal_speedup` the plain jit's fastest step over the ideal: the
share of the step the ops themselves explain, and the most this table
could give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from pipejax.errors import DeviceError

WORKER = "pipejax.bench.core_job"  # not imported by the package: `python -m` runs it clean


def row_key(row: dict) -> str:
    """A row's name in the job's files and the JSON: model, table, M, K."""
    return f"{row['model']}/{row['schedule']}/{row['remat']}/M={row['M']}/K={row['K']}"


def measure(model: str, K: int, M: int, families: list[tuple[str, str]], repeats: int,
            folder: Path) -> list[dict]:
    """The rows of `families` ((schedule, remat) pairs) of `model` at K
    pinned processes and M micro-batches, with the plain jit alone before
    and after."""
    from pipejax import distributed

    rows = [{"model": model, "schedule": s, "remat": r, "M": M, "K": K} for s, r in families]
    cmd = [sys.executable, "-m", WORKER, "--rows", json.dumps(rows), "--repeats", str(repeats),
           "--folder", str(folder)]
    env = dict(os.environ, PIPEJAX_CORE=str(sorted(os.sched_getaffinity(0))[0]),
               XLA_FLAGS=distributed.child_flags(pinned=True))  # one device, one thread

    def plain_alone() -> list[float]:
        subprocess.run([*cmd, "--plain"], env=env, check=True, timeout=1800)
        return json.loads((folder / "plain.json").read_text())  # [median, least]

    before = plain_alone()
    code = distributed.launch(cmd, K, 1, timeout=1800, pinned=True)
    if code:
        raise DeviceError(f"the {K} pinned processes of the cores benchmark failed "
                          f"(exit status {code}); run `python -m {WORKER}` under "
                          "`pj.distributed.launch` to see process 0's error")
    job, plain = json.loads((folder / "job.json").read_text()), [before, plain_alone()]
    base, least = min(p[0] for p in plain), min(p[1] for p in plain)
    ms = lambda s: round(1e3 * s, 1)
    out = []
    for row in rows:
        got = job[row_key(row)]
        out.append({**row, "ticks": got["ticks"], "ms": ms(got["seconds"]),
                    "plain_ms": ms(base), "plain_ms_before_after": [ms(p[0]) for p in plain],
                    "plain_in_job_ms": ms(job["plain"]),
                    "speedup": round(base / got["seconds"], 3),
                    "least_ms": ms(got["least"]), "plain_least_ms": ms(least),
                    "least_speedup": round(least / got["least"], 3),
                    "ideal_ms": ms(got["ideal"]), "ideal_speedup": round(least / got["ideal"], 3),
                    "of_ideal": round(got["ideal"] / got["least"], 3),
                    "lockstep_ms": ms(got["lockstep"]), "coupled_ms": ms(got["coupled"]),
                    "ops_ms": {op: ms(t) for op, t in got["ops"].items()},
                    "busy_ms": got["busy_ms"], "collective_ms": got["collective_ms"]})
    return out


def cores(repeats: int, models: tuple[str, ...] = ("gpt",), Ms: tuple[int, ...] = (8,),
          done: list[dict] = (), save: Callable[[list[dict]], None] | None = None,
          K: int = 2) -> list[dict]:
    """Every registered family of each of `models` at K pinned processes and
    each of `Ms` micro-batches, both remats where the family runs both (a
    table whose backward runs on other weights than its forward keeps no
    residuals without weight stashing: remat "stage"). A row in `done`
    (same model, table, M, K) is kept, not run again; `save` gets every row
    after each job, so a long sweep runs in parts."""
    import tempfile

    from pipejax.schedules import FAMILIES

    consistent = lambda f: f.table(K, 2 * K, f.virtual).consistent
    tables = [(name, remat) for name, family in FAMILIES.items()
              for remat in (("none", "stage") if consistent(family) else ("stage",))]
    rows = list(done)
    have = {row_key(r) for r in rows}
    for model in models:
        for M in Ms:
            todo = [t for t in tables if row_key({"model": model, "schedule": t[0],
                                                "remat": t[1], "M": M, "K": K}) not in have]
            if not todo:
                continue
            with tempfile.TemporaryDirectory() as folder:
                rows += measure(model, K, M, todo, min(repeats, 7), Path(folder))
            if save is not None:
                save(rows)
    return rows

