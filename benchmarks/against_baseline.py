"""Step time, bytes accessed and compiled memory of this checkout against a baseline, in one run.

A change to the executor must not make pipelines slower or larger. Each
configuration (MLP 8x512, K = 4, M = 8, micro-batch 32, Adam, every
schedule, PipeDream with weight stashing at remat="none" and without at
"stage"; and K = 1, M = 4: the MLP at micro-batch 64 and a Transformer
4x256 at micro-batch 8) runs in two worker processes, one importing this checkout's pipejax, one the
baseline's (`--baseline DIR`, e.g. made by `git worktree add /tmp/base
<commit>`); the parent alternates timed rounds between them, so the drifts
of this shared machine hit both alike. Reported per configuration: the
median ratio of step times (new / baseline), XLA's bytes accessed, its
compiled temp bytes and peak bytes (argument + output − alias + temp).

Interleaved 1F1B (v = 2), ZB-H1 (v = 1 and 2) and GPipe over v = 2 chunks run
at K = 4 too.

Run: python benchmarks/against_baseline.py --baseline /tmp/base [--rounds 15] [--name NAME]
[--schedules S ...] [--virtual V]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# (model, K, M, micro-batch, schedule, remat, virtual)
CONFIGS = [("mlp", 4, 8, 32, "gpipe", "none", 1), ("mlp", 4, 8, 32, "1f1b", "none", 1),
           ("mlp", 4, 8, 32, "pipedream", "none", 1), ("mlp", 4, 8, 32, "pipedream", "stage", 1),
           ("mlp", 4, 8, 32, "pb", "stage", 1),
           ("mlp", 1, 4, 64, "gpipe", "none", 1), ("transformer", 1, 4, 8, "gpipe", "none", 1),
           ("mlp", 4, 8, 32, "interleaved", "stage", 2), ("mlp", 4, 8, 32, "zb-h1", "none", 1),
           ("mlp", 4, 8, 32, "zb-h1", "none", 2), ("mlp", 4, 8, 32, "gpipe", "none", 2)]
STEPS = 5  # steps per timed round


def worker(model: str, K: int, M: int, MB: int, schedule: str, remat: str, virtual: int) -> None:
    """Build, compile and report memory; then time `STEPS` steps per line read."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import pipejax as pj
    from pipejax.bench import peak_bytes
    from pipejax.bench.speed import cost

    layers, features = ((pj.models.mlp(depth=8, width=512), 40) if model == "mlp" else
                        (pj.models.transformer(layers=4, dim=256, heads=4, patch=4), 256))
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, features)),
                       stages=K, microbatches=M, schedule=schedule, remat=remat,
                       weight_stashing=schedule == "pipedream" and remat == "none",
                       virtual=virtual)
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jax.random.normal(jax.random.key(1), (M * MB, features)),
             jax.random.randint(jax.random.key(2), (M * MB,), 0, 10))
    compiled = trainer.step.lower(state, batch).compile()
    print(json.dumps({"temp": int(compiled.memory_analysis().temp_size_in_bytes),
                      "peak": peak_bytes(compiled),
                      "accessed": int(cost(compiled).get("bytes accessed", 0))}), flush=True)
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics["loss"])
    for line in sys.stdin:
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        print(json.dumps(float(np.median(times))), flush=True)


def spawn(checkout: Path, config: tuple) -> subprocess.Popen:
    """A worker importing `checkout`'s pipejax (run from a directory without one)."""
    env = dict(os.environ, PYTHONPATH=str(checkout),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *map(str, config)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, cwd="/")


def compare(baseline: Path, rounds: int, configs: list[tuple]) -> list[dict]:
    here = Path(__file__).resolve().parents[1]
    rows = []
    for config in configs:
        procs = {"new": spawn(here, config), "baseline": spawn(baseline, config)}
        memory = {name: json.loads(p.stdout.readline()) for name, p in procs.items()}
        times = {name: [] for name in procs}
        for _ in range(rounds):
            for name, p in procs.items():
                p.stdin.write("go\n")
                p.stdin.flush()
                times[name].append(json.loads(p.stdout.readline()))
        for p in procs.values():
            p.stdin.close()
            p.wait()
        ratio = sorted(a / b for a, b in zip(times["new"], times["baseline"]))[rounds // 2]
        model, K, M, MB, schedule, remat, virtual = config
        rows.append({"model": model, "K": K, "M": M, "schedule": schedule, "remat": remat,
                     "virtual": virtual,
                     "new_ms": round(1e3 * sorted(times["new"])[rounds // 2], 2),
                     "baseline_ms": round(1e3 * sorted(times["baseline"])[rounds // 2], 2),
                     "time_ratio": round(ratio, 3),
                     "accessed_ratio": round(memory["new"]["accessed"]
                                             / memory["baseline"]["accessed"], 3),
                     **{f"{name}_{part}": memory[name][part]
                        for part in ("temp", "peak") for name in ("new", "baseline")}})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        model, K, M, MB, schedule, remat, virtual = sys.argv[2:9]
        return worker(model, int(K), int(M), int(MB), schedule, remat, int(virtual))
    sys.path.insert(0, str(Path(__file__).parent))
    from common import save, table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout to compare with")
    parser.add_argument("--rounds", type=int, default=15, help="alternated timed rounds")
    parser.add_argument("--schedules", nargs="*", help="only the configurations of these schedules")
    parser.add_argument("--virtual", type=int, help="only the configurations of v chunks a device")
    parser.add_argument("--name", default="against_baseline",
                        help="the JSON's name under results/")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    configs = [c for c in CONFIGS if (not args.schedules or c[4] in args.schedules)
               and args.virtual in (None, c[6])]
    rows = compare(args.baseline, args.rounds, configs)
    print(table(rows))
    print(f"wrote {save(args.name, {'baseline': commit, 'rows': rows})}")


if __name__ == "__main__":
    main()
