"""The GPU section of `pipejax bench` (pipejax/bench/gpu.py): the zoo GPT at
GPT-2 small's size, plain `jax.jit` against the pipelined step, bf16 and
float32, in one command that needs only the GPU machine's own packages.

Run (on the GPU machine, from the repository): make gpu
  or: PYTHONPATH=. python3 -m pipejax bench --only gpu [--budget SECONDS]
Writes benchmarks/results/bench_gpu.json; `--smoke` runs a tiny GPT anywhere.

The goals the JSON is read against: the pipelined step at K = 1 within
1.05x the plain jit's step time with the same bytes accessed, in bf16 and
float32, and its bf16 model FLOP utilisation at least 0.95 of the plain jit's;
on a language model's vocabulary, the plain jit's bf16 MFU at least 0.40 and
every K = 1 row's at least 0.97 of it.
"""

import sys

from common import RESULTS, load, markdown
from pipejax.cli import main

STEP_GOAL, MFU_GOAL = 1.05, 0.95
LM_MFU_GOAL, LM_OVER_GOAL = 0.40, 0.97  # the language model group's plain jit, K = 1 rows
MISSING = "Not measured yet: no `benchmarks/results/bench_gpu.json`."
COLUMNS = ("step", "K", "M", "ms", "over_plain", "over_1f1b", "tokens_per_s", "model_tflops",
           "mfu", "mfu_over_plain", "gb_accessed", "bytes_over_plain", "bytes_over_1f1b",
           "peak_gb", "compile_s")


def _goals(section: dict) -> list[dict]:
    """Each goal with the worst K = 1 pipelined row's figure and whether it holds."""
    rows = []
    for dtype in ("bfloat16", "float32"):
        pipelined = [r for r in section.get(dtype, [])
                     if "over_plain" in r and not r["step"].startswith("plain")]
        if not pipelined:
            rows.append({"goal": f"{dtype}: K = 1 against the plain jit",
                         "measured": "not measured", "met": "–"})
            continue
        worst = max(pipelined, key=lambda r: r["over_plain"])
        most = max(r["bytes_over_plain"] or 0.0 for r in pipelined)
        rows.append({"goal": f"{dtype}: K = 1 step ≤ {STEP_GOAL}× its plain jit",
                     "measured": f"{worst['over_plain']:.3f} ({worst['step']})",
                     "met": "yes" if worst["over_plain"] <= STEP_GOAL else "no"})
        rows.append({"goal": f"{dtype}: the same bytes accessed", "measured": f"{most:.3f}",
                     "met": "yes" if most <= 1.0 else "no"})
        if dtype == "bfloat16":
            mfu = min(r["mfu_over_plain"] for r in pipelined)
            rows.append({"goal": f"bfloat16: K = 1 MFU ≥ {MFU_GOAL} of the plain jit's",
                         "measured": f"{mfu:.3f}", "met": "yes" if mfu >= MFU_GOAL else "no"})
    return rows + _lm_goals(section)


def _lm_key(section: dict) -> str | None:
    """The language model group's key in the section, or None before it ran."""
    return f"bfloat16 vocab={section['lm']['vocab']}" if "lm" in section else None


def _lm_goals(section: dict) -> list[dict]:
    """The language model group's goals: the plain jit's bf16 MFU, and every
    K = 1 row's MFU over it."""
    key = _lm_key(section)
    rows = {r["step"]: r for r in section.get(key, [])} if key else {}
    plain = rows.get("plain jit", {}).get("mfu")
    k1 = [r for r in rows.values() if "mfu_over_plain" in r]
    worst = min(k1, key=lambda r: r["mfu_over_plain"]) if k1 else None
    goal = "bfloat16 on a language model's vocabulary"
    return [{"goal": f"{goal}: plain jit MFU ≥ {LM_MFU_GOAL:.2f}",
             "measured": "not measured" if plain is None else f"{plain:.3f}",
             "met": "–" if plain is None else "yes" if plain >= LM_MFU_GOAL else "no"},
            {"goal": f"{goal}: K = 1 MFU ≥ {LM_OVER_GOAL} of the plain jit's",
             "measured": "not measured" if worst is None
             else f"{worst['mfu_over_plain']:.3f} ({worst['step']})",
             "met": "–" if worst is None
             else "yes" if worst["mfu_over_plain"] >= LM_OVER_GOAL else "no"}]


def _setting(section: dict, env: dict) -> str:
    """The machine, the model and how the rows were measured, in one paragraph."""
    model = section["model"]
    peaks = ", ".join(f"{d} {p / 1e12:.1f} TFLOP/s" for d, p in section["peaks"].items() if p)
    return (
        f"{env['device']} ({env['devices']} device{'s' * (env['devices'] > 1)}, driver "
        f"{env['driver']}), JAX {env['jax']}, Python {env['python']}, {env['date'][:10]}: "
        f"the zoo GPT, {model['depth']} blocks of width {model['width']}, {model['heads']} heads, "
        f"context {model['context']}, vocabulary {model['vocab']} (bytes; "
        f"{model['parameters'] / 1e6:.1f} M parameters); a step is M = {model['M']} "
        f"micro-batches of {model['micro']} sequences "
        f"({model['M'] * model['micro'] * model['context']} tokens), AdamW; "
        f"{section['flops_per_step'] / 1e12:.2f} TFLOP a step (forward + backward, "
        f"`pj.trace`'s count); dense peaks {peaks or 'unknown for this device'}; "
        f"median of up to {model['repeats']} alternated rounds (`{env['command']}`, "
        f"{section['seconds']:.0f} s)." + _lm_setting(section))


def _lm_setting(section: dict) -> str:
    """The language model group's model, in a sentence (empty before it ran)."""
    if "lm" not in section:
        return ""
    lm = section["lm"]
    return (f" The language model group: the same blocks on a vocabulary of {lm['vocab']} "
            f"(random tokens; {lm['parameters'] / 1e6:.1f} M parameters, the head untied), "
            f"{lm['flops_per_step'] / 1e12:.2f} TFLOP a step, bf16.")


def _split_costs(section: dict, env: dict) -> str:
    """What a ring row read at a dynamic index and the zero-bubble split
    cost on the GPU, in one sentence: GPipe at K = 1 with remat "none"
    (its backward reads every kept residual from a ring of M rows) over
    1F1B at K = 1 (one vjp, no ring), each over the plain jit, and zb-h1
    over 1F1B where measured."""
    rows = {d: {r["step"]: r for r in section.get(d, [])} for d in ("bfloat16", "float32")}
    over = lambda d, step: rows[d].get(step, {}).get("over_plain")
    ring = [f"{over(d, 'gpipe remat=none') / over(d, '1f1b remat=none'):.3f}× in {d}"
            for d in rows if over(d, "gpipe remat=none") and over(d, "1f1b remat=none")]
    if not ring:
        return "On a GPU: not measured yet (`make gpu`)."
    split = [f"{r['over_1f1b']:.3f}× ({d}, {r['step'].split()[1]})" for d in rows
             for r in rows[d].values() if "over_1f1b" in r]
    return (f"On one {env['device']} (`make gpu`, `bench_gpu.json`), GPipe at K = 1 with remat "
            f"\"none\", whose backward reads every kept residual from a ring of M rows at a "
            f"dynamic row, takes {' and '.join(ring)} the step of 1F1B at K = 1, whose one vjp "
            f"keeps nothing in a ring (each over the plain jit); zb-h1 at K = 1 against 1F1B: "
            + (", ".join(split) + "." if split else "not measured yet."))


def tables() -> dict[str, str]:
    """The memory page's GPU tables and the README's line, from bench_gpu.json
    ("not measured yet" without it)."""
    if not (RESULTS / "bench_gpu.json").exists():
        return {**dict.fromkeys(("setting", "bfloat16", "float32", "lm", "goals"), MISSING),
                "headline": "not measured yet (no `bench_gpu.json`).",
                "split_costs": "On a GPU: not measured yet (`make gpu`)."}
    result = load("bench_gpu")
    section, env = result["gpu"], result.get("rerun", {}).get("gpu", result["environment"])
    table = lambda key: markdown([{k: r.get(k) for k in (*COLUMNS, "error") if k in r}
                                  for r in section[key]]) if section.get(key) else MISSING
    k1 = {r["step"]: r for r in section.get("bfloat16", [])}.get("1f1b remat=none", {})
    plain = {r["step"]: r for r in section.get("bfloat16", [])}.get("plain jit", {})
    headline = "no bf16 K = 1 row measured." if "over_plain" not in k1 else (
        f"on one {env['device']}, the zoo GPT with GPT-2 small's blocks (12 × 768, "
        f"{section['model']['parameters'] / 1e6:.0f} M parameters over bytes) in bf16 steps at "
        f"K = 1 (1F1B) in {k1['over_plain']:.3f}× the time of a plain `jax.jit` of the same "
        f"micro-batches with {k1['bytes_over_plain']:.3f}× its bytes accessed, "
        f"{k1['tokens_per_s'] / 1e3:.0f} k tokens/s"
        + ("." if k1["mfu"] is None else
           f", MFU {k1['mfu']:.3f} (the plain jit's {plain['mfu']:.3f})."))
    return {"setting": _setting(section, env), "bfloat16": table("bfloat16"),
            "float32": table("float32"), "lm": table(_lm_key(section)) if "lm" in section
            else "Not measured yet: the JSON predates the language model group.",
            "goals": markdown(_goals(section)), "headline": headline,
            "split_costs": _split_costs(section, env)}


if __name__ == "__main__":
    sys.exit(main(["bench", "--only", "gpu", *sys.argv[1:]]))
