"""The GPU section of `pipejax bench` (pipejax/bench/gpu.py): the zoo GPT at
GPT-2 small's size, plain `jax.jit` against the pipelined step, bf16 and
float32, in one command that needs only the GPU machine's own packages.

Run (on the GPU machine, from the repository): make gpu
  or: PYTHONPATH=. python3 -m pipejax bench --only gpu [--budget SECONDS]
Writes benchmarks/results/bench_gpu.json; `--smoke` runs a tiny GPT anywhere.

The goals the JSON is read against: the pipelined step at K = 1 within
1.05x the plain jit's step time with the same bytes accessed, in bf16 and
float32, and its bf16 model FLOP utilisation at least 0.95 of the plain jit's.
"""

import sys

from common import RESULTS, load, markdown
from pipejax.cli import main

STEP_GOAL, MFU_GOAL = 1.05, 0.95
LIMIT = {"pb": "plain jit per micro-batch"}  # the plain step a row is read against


def _ratios(rows: list[dict]) -> list[dict]:
    """Each measured row with its step time and MFU over its plain step's."""
    by = {r["step"]: r for r in rows if "error" not in r}
    out = []
    for r in rows:
        limit = by.get(LIMIT.get(r["step"], "plain jit"))
        if "error" in r or limit is None or r["K"] > 1:
            out.append({**r, "over_plain": None, "mfu_over_plain": None})
            continue
        out.append({**r, "over_plain": round(r["ms"] / limit["ms"], 3),
                    "bytes_over_plain": round(r["gb_accessed"] / limit["gb_accessed"], 3),
                    "mfu_over_plain": None if r["mfu"] is None
                    else round(r["mfu"] / limit["mfu"], 3)})
    return out


def _goals(section: dict) -> list[dict]:
    """Each goal with the worst K = 1 pipelined row's figure and whether it holds."""
    rows = []
    for dtype in ("bfloat16", "float32"):
        pipelined = [r for r in _ratios(section.get(dtype, []))
                     if r["over_plain"] is not None and not r["step"].startswith("plain")]
        if not pipelined:
            continue
        worst = max(pipelined, key=lambda r: r["over_plain"])
        bytes_worst = max(r["bytes_over_plain"] for r in pipelined)
        rows.append({"goal": f"{dtype}: K = 1 step ≤ {STEP_GOAL}× its plain jit",
                     "measured": f"{worst['over_plain']:.3f} ({worst['step']})",
                     "met": "yes" if worst["over_plain"] <= STEP_GOAL else "no"})
        rows.append({"goal": f"{dtype}: the same bytes accessed",
                     "measured": f"{bytes_worst:.3f}", "met": "yes" if bytes_worst <= 1.0 else "no"})
        if dtype == "bfloat16" and worst["mfu_over_plain"] is not None:
            mfu = min(r["mfu_over_plain"] for r in pipelined)
            rows.append({"goal": f"bfloat16: K = 1 MFU ≥ {MFU_GOAL} of the plain jit's",
                         "measured": f"{mfu:.3f}", "met": "yes" if mfu >= MFU_GOAL else "no"})
    return rows


def tables() -> dict[str, str]:
    """The memory page's GPU tables and the README's line, from bench_gpu.json
    ("not measured yet" without it)."""
    if not (RESULTS / "bench_gpu.json").exists():
        missing = "Not measured yet: no `benchmarks/results/bench_gpu.json`."
        return {"setting": missing, "bfloat16": "", "float32": "", "goals": "",
                "headline": "not measured yet (no `bench_gpu.json`)."}
    result = load("bench_gpu")
    section, env = result["gpu"], result.get("rerun", {}).get("gpu", result["environment"])
    model = section["model"]
    columns = ("step", "K", "M", "ms", "over_plain", "tokens_per_s", "mfu", "mfu_over_plain",
               "gb_accessed", "peak_gb", "compile_s")
    table = lambda dtype: markdown([{k: r.get(k) for k in columns} | (
        {"error": r["error"]} if "error" in r else {}) for r in _ratios(section[dtype])])
    peaks = ", ".join(f"{d} {p / 1e12:.1f} TFLOP/s" for d, p in section["peaks"].items() if p)
    setting = (
        f"{env['device']} ({env['devices']} device{'s' * (env['devices'] > 1)}, driver "
        f"{env['driver']}), JAX {env['jax']}, Python {env['python']}, {env['date'][:10]}: "
        f"the zoo GPT, {model['depth']} blocks of width {model['width']}, {model['heads']} heads, "
        f"context {model['context']}, vocabulary {model['vocab']} "
        f"({model['parameters'] / 1e6:.1f} M parameters); a step is M = {model['M']} "
        f"micro-batches of {model['micro']} sequences ({model['M'] * model['micro'] * model['context']} "
        f"tokens), AdamW; {section['flops_per_step'] / 1e12:.2f} TFLOP a step (forward + backward, "
        f"`pj.trace`'s count); dense peaks {peaks or 'unknown for this device'}; median of up "
        f"to {model['repeats']} alternated rounds (`{env['command']}`, {section['seconds']:.0f} s).")
    goals = _goals(section)
    bf16 = {r["step"]: r for r in _ratios(section.get("bfloat16", []))}
    k1 = bf16.get("1f1b remat=none")
    headline = "not measured on this device yet." if k1 is None or k1["over_plain"] is None else (
        f"on one {env['device']}, the GPT-2-small-sized zoo GPT in bf16 steps at K = 1 "
        f"(1F1B) in {k1['over_plain']:.3f}× the time of a plain `jax.jit` of the same "
        f"micro-batches with the same bytes accessed ({k1['bytes_over_plain']:.3f}), "
        f"{k1['tokens_per_s'] / 1e3:.0f} k tokens/s, MFU {k1['mfu']:.3f} "
        f"(the plain jit's {bf16['plain jit']['mfu']:.3f}).")
    return {"setting": setting, "bfloat16": table("bfloat16") if "bfloat16" in section else "",
            "float32": table("float32") if "float32" in section else "",
            "goals": markdown(goals) if goals else "", "headline": headline}


if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "gpu", *sys.argv[1:]]))
