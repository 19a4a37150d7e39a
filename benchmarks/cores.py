"""The cores section of `pipejax bench` (pipejax/bench/cores.py): every
schedule family at K = 2 stages in 2 processes, each pinned to its own core
(XLA:CPU on one thread, gloo between them), against the plain jit alone on
one pinned core; per row the table's ideal step from its ops timed alone.

Run: python benchmarks/cores.py [--models gpt mlp] [--microbatches 4 8 16]
  or: pipejax bench --only cores ...
One job of under 10 minutes per model and M on 2 cores; rows already in
benchmarks/results/bench_cpu.json are kept, so a sweep runs in parts.
"""

import sys

from common import RESULTS, agreement, load, markdown
from pipejax.cli import main

COLUMNS = ("schedule", "remat", "ticks", "ms", "speedup", "least_ms", "least_speedup",
           "ideal_ms", "ideal_speedup", "of_ideal", "lockstep_ms", "coupled_ms", "busy_ms",
           "collective_ms")
MISSING = "Not measured yet: `python benchmarks/cores.py`."


def _summary(rows: list[dict]) -> str:
    """The GPT at M = 8 in one sentence: 1F1B's speed-up and its ideal, and
    each other table's step over 1F1B's at the same remat, median and
    fastest call."""
    rows = {(r["schedule"], r["remat"]): r for r in rows if (r["model"], r["M"]) == ("gpt", 8)}
    if not rows:
        return MISSING
    best = min((r for (s, _), r in rows.items() if s == "1f1b"), key=lambda r: r["ms"])
    over = lambda r, key: r[key] / rows.get(("1f1b", r["remat"]), best)[key]
    others = ", ".join(f"{s} {m} {over(r, 'ms'):.2f}× ({over(r, 'least_ms'):.2f}×)"
                       for (s, m), r in rows.items() if s != "1f1b")
    return (f"1F1B (remat \"{best['remat']}\") takes {best['ms']} ms against the plain jit's "
            f"{best['plain_ms']} ms alone on one core, a speed-up of {best['speedup']} "
            f"(fastest calls: {best['least_speedup']}; its ideal from its ops alone "
            f"{best['ideal_speedup']}, of which it reaches {best['of_ideal']}); each other "
            f"table's median step over 1F1B's at the same remat (in brackets, its fastest "
            f"call over 1F1B's: where the two disagree, the host's noise decides): {others}")


def _yardsticks(rows: list[dict]) -> str:
    """How well each yardstick ranks the tables' fastest steps: Spearman's
    correlation per model and M, of `ideal_ms` (each op as early as its
    input), `lockstep_ms` and `coupled_ms` (as the collectives couple the
    devices) with `least_ms`."""
    out = []
    for model, M in dict.fromkeys((r["model"], r["M"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["M"]) == (model, M) and "coupled_ms" in r]
        if len(mine) < 3:
            continue
        least = [r["least_ms"] for r in mine]
        rho = {name: agreement([r[key] for r in mine], least)["spearman"]
               for name, key in (("as early as its input", "ideal_ms"),
                                 ("lock step", "lockstep_ms"), ("coupled", "coupled_ms"))}
        out.append(f"{model} M = {M}: " + ", ".join(f"{k} {v:.2f}" for k, v in rho.items()))
    return "; ".join(out) if out else MISSING


def tables() -> dict[str, str]:
    """The schedules page's tables, one per model and M (`gpt_8`), the
    setting they were measured in and the GPT's summary at M = 8."""
    out = {"setting": MISSING, "summary": MISSING, "yardsticks": MISSING,
           **{f"{model}_{M}": MISSING for model in ("gpt", "mlp") for M in (4, 8, 16)}}
    if not (RESULTS / "bench_cpu.json").exists():
        return out
    result = load("bench_cpu")
    rows = result.get("cores", [])
    if not rows:
        return out
    env = result.get("rerun", {}).get("cores", result["environment"])
    out["summary"] = _summary(rows)
    out["yardsticks"] = _yardsticks(rows)
    for model, M in dict.fromkeys((r["model"], r["M"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["M"]) == (model, M)]
        plain = [{"schedule": "plain jit alone", "ms": mine[0]["plain_ms"],
                  "least_ms": mine[0]["plain_least_ms"]}]
        if "plain_in_job_ms" in mine[0]:
            plain.append({"schedule": "plain jit in the job", "ms": mine[0]["plain_in_job_ms"]})
        out[f"{model}_{M}"] = markdown([{k: r.get(k, "") for k in COLUMNS}
                                        for r in plain + mine])
    out["setting"] = (f"`{env['command']}` on {env['cpus']} cores ({env['date'][:10]}, "
                      f"jax {env['jax']}), K = {rows[0]['K']} processes pinned one to a core")
    return out


if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "cores", *sys.argv[1:]]))
