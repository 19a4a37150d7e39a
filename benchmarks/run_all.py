"""Every measurement of `pipejax bench` in one run (the same command).

Run: python benchmarks/run_all.py [--repeats N] [--only SECTION ...] [--out PATH]
"""

import sys

from common import load, markdown
from pipejax.cli import main


def tables() -> dict[str, str]:
    """The memory page's tables from bench_cpu.json: a summary of each
    section, and the padding of every model's splits."""
    result = load("bench_cpu")
    bubbles = result["bubbles"]
    exact = all(r[f"table_n={n}"] == r[f"formula_n={n}"] for r in bubbles for n in (1, 32))
    formulas: dict[str, set] = {}
    for r in bubbles:
        formulas.setdefault(r["formula"], set()).add(r["schedule"] + (f" v = {r['v']}" if r["v"] > 1 else ""))
    over = result["overhead"]
    by_m = {r["M"]: r for r in result["compile"]["by_microbatches"]}
    deepest = max(result["compile"]["by_depth"], key=lambda r: r["layers"])
    padding = {r["model"]: r["default_padding"] for r in result["padding"] if r["K"] == 4}
    summary = [
        ("bubble, every schedule, K ∈ {4, 8}, 1 and 32 steps",
         f"{'equal to' if exact else 'NOT equal to'} the closed form ({len(bubbles)} tables; "
         + "; ".join(f"{', '.join(sorted(names))}: `{f}`" for f, names in formulas.items()) + ")"),
        ("1-stage step / plain jit, same 4 micro-batches: " + " / ".join(r["model"] for r in over),
         " / ".join(f"{r['over_microbatched']:.3f}" for r in over) + " (bytes "
         + " / ".join(f"{r['bytes_over_microbatched']:.3f}" for r in over) + ")"),
        (f"compile time K = 4, M = {max(by_m)} / M = {min(by_m)}",
         f"{by_m[max(by_m)]['step_compile_s']:.2f} s / {by_m[min(by_m)]['step_compile_s']:.2f} s"),
        (f"compile time of the {deepest['layers']}-layer model, shared / per-stage branches",
         f"{deepest['step_compile_s']:.2f} s / {deepest['per_stage_step_compile_s']:.2f} s"),
        ("padding of packed parameters, K = 4", ", ".join(f"{m} {p}" for m, p in padding.items())),
    ]
    split = lambda r, name: (None if r[f"{name}_split"] is None else
                             f"{tuple(r[f'{name}_split'])}: {r[f'{name}_padding']}, "
                             f"{r[f'{name}_cost']:.2f}")
    return {
        "summary": markdown([{"measure (`bench_cpu.json`)": m, "value": v} for m, v in summary]),
        "padding": markdown([{"model, K": f"{r['model']}, {r['K']}",
                              "default split: padding, cost": split(r, "default"),
                              "with `max_padding`": "none lower" if r["max_padding"] is None
                              else f"{r['max_padding']} → {split(r, 'bounded')}",
                              "least of any split": r["least_padding_any_split"]}
                             for r in result["padding"]]),
    }


if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
