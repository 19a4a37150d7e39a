"""Schedules on real cores: K stages in K processes, each pinned to its own
core with XLA:CPU on one thread, gloo between them (`distributed.launch`
with `pinned`). There an idle tick is an idle core, as on GPUs, and a
message crosses a process boundary; simulated devices in one process share
the cores, so a schedule's bubble costs them nothing.

Each row is one table (family, remat) at K stages on the zoo GPT, timed in
one K-process job with every row's step called in turn (`speed.alternate`),
medians. The baseline is the plain jit of the same micro-batches
(`plain_microbatched`: the gradients of M micro-batches summed, one AdamW
update) alone on one pinned core, in a process of its own run before and
after the job (a pinned process cannot share the job's cores with it
without changing what it measures); its speed-up is that median over the
row's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipejax.errors import DeviceError

WORKER = "pipejax.bench.cores"
GPT = {"depth": 6, "width": 128, "heads": 4, "context": 128}
MICRO = 4  # sequences a micro-batch


def _model():
    import pipejax as pj

    return pj.models.gpt(**GPT)


def _batch(M: int):
    import jax
    import jax.numpy as jnp

    x = jax.random.randint(jax.random.key(0), (M * MICRO, GPT["context"]), 0, 256)
    return x, jnp.roll(x, -1, axis=1)


def _pipelined(rows: list[dict], M: int, repeats: int) -> dict[str, float]:
    """Inside the K-process job: the median seconds of each row's step."""
    import jax
    import optax

    import pipejax as pj
    from pipejax.bench.speed import alternate

    K = jax.device_count()
    layers, (x, y) = _model(), _batch(M)
    runs = {}
    for row in rows:
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MICRO],
                           targets=y[:MICRO], stages=K, microbatches=M,
                           schedule=row["schedule"], remat=row["remat"],
                           mesh=pj.make_mesh(K))
        trainer = pipe.trainer(optax.adamw(1e-3))
        state = [trainer.init(pipe.init(jax.random.key(0)))]

        def run(trainer=trainer, state=state):
            state[0], metrics = trainer.step(state[0], (x, y))
            jax.block_until_ready(metrics["loss"])
        runs[_key(row)] = run
    return {name: float(np.median(t)) for name, t in alternate(runs, repeats).items()}


def _plain(M: int, repeats: int) -> float:
    """Alone on one pinned core: the median seconds of the plain jit's step."""
    import jax
    import optax

    import pipejax as pj
    from pipejax.bench.speed import alternate, plain_steps
    from pipejax.layers import initial_variables

    layers, (x, y) = _model(), _batch(M)
    opt = optax.adamw(1e-3)
    step = jax.jit(plain_steps(layers, M, opt, ("plain_microbatched",),
                               pj.losses.next_token)["plain_microbatched"])
    v = initial_variables(layers, x[:MICRO], jax.random.key(0))
    state = [v, opt.init(v)]

    def run():
        state[0], state[1], loss = step(state[0], state[1], x, y)
        jax.block_until_ready(loss)
    return float(np.median(alternate({"plain": run}, repeats)["plain"]))


def _key(row: dict) -> str:
    return f"{row['schedule']}/{row['remat']}/M={row['M']}"


def worker(argv: list[str]) -> int:
    """One process of a job (`--rows` JSON, `--out` where process 0 writes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--rows", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--plain", action="store_true")
    args = p.parse_args(argv)
    rows = json.loads(args.rows)
    from pipejax import distributed

    if args.plain:
        distributed.pin()
        args.out.write_text(json.dumps({"plain": _plain(rows[0]["M"], args.repeats)}))
        return 0
    distributed.initialize()
    import jax

    times = _pipelined(rows, rows[0]["M"], args.repeats)
    if jax.process_index() == 0:
        args.out.write_text(json.dumps(times))
    return 0


def measure(K: int, M: int, families: list[tuple[str, str]], repeats: int,
            folder: Path) -> list[dict]:
    """The rows of `families` ((schedule, remat) pairs) at K pinned processes
    and M micro-batches, with the plain jit alone before and after."""
    from pipejax import distributed

    rows = [{"schedule": s, "remat": r, "M": M, "K": K} for s, r in families]
    spec = json.dumps(rows)
    cmd = [sys.executable, "-m", WORKER, "--rows", spec, "--repeats", str(repeats)]
    env = dict(os.environ, PIPEJAX_CORE=str(sorted(os.sched_getaffinity(0))[0]),
               XLA_FLAGS=distributed.child_flags(pinned=True))  # one device, one thread
    alone = folder / "plain.json"

    def plain_alone() -> float:
        subprocess.run([*cmd, "--plain", "--out", str(alone)], env=env, check=True,
                       timeout=1800)
        return json.loads(alone.read_text())["plain"]

    before, job = plain_alone(), folder / "job.json"
    code = distributed.launch([*cmd, "--out", str(job)], K, 1, timeout=1800, pinned=True)
    if code:
        raise DeviceError(f"the {K} pinned processes of the cores benchmark failed "
                          f"(exit status {code}); run `python -m {WORKER}` under "
                          "`pj.distributed.launch` to see process 0's error")
    times, plain = json.loads(job.read_text()), [before, plain_alone()]
    base = min(plain)
    out = []
    for row in rows:
        seconds = times[_key(row)]
        out.append({**row, "ms": round(1e3 * seconds, 1), "plain_ms": round(1e3 * base, 1),
                    "plain_ms_before_after": [round(1e3 * t, 1) for t in plain],
                    "speedup": round(base / seconds, 3)})
    return out


def cores(repeats: int, K: int = 2, M: int = 8) -> list[dict]:
    """Every registered family at K pinned processes and M micro-batches,
    both remats where the family runs both (an asynchronous table without
    weight stashing keeps no residuals across versions: remat "stage")."""
    import tempfile

    from pipejax.schedules import FAMILIES

    rows = [(name, remat) for name, family in FAMILIES.items()
            for remat in (("stage",) if family.asynchronous else ("none", "stage"))]
    with tempfile.TemporaryDirectory() as folder:
        return measure(K, M, rows, min(repeats, 7), Path(folder))


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
