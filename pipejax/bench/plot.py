"""One PNG of the bench: memory, compile time against depth, bubbles, and
the schedules' speed-up on separate cores against M."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipejax.bench.bubbles import bubble_formula


def plot(results: dict, path: Path) -> bool:
    """One PNG: compiled against predicted memory, compile time against
    depth (shared and per-stage branches), the bubble against M and the
    speed-up on separate cores against M; False when `results` has none of
    them."""
    panels = [p for p in ("memory", "compile", "bubbles", "cores") if results.get(p)]
    if not panels:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "memory":
            rows = results["memory"]
            ax.scatter([r["compiled_bytes"] / 2**20 for r in rows],
                       [r["predicted_bytes"] / 2**20 for r in rows])
            top = max(max(r["compiled_bytes"], r["predicted_bytes"]) for r in rows) / 2**20
            for f, style in ((1.0, "-"), (1.25, ":"), (0.75, ":")):
                ax.plot([0, top], [0, f * top], "k" + style, lw=0.8)
            ax.set(xlabel="compiled MiB per device", ylabel="predicted MiB",
                   title="memory (MLP, ResNet; K=4; ±25 %)")
        elif panel == "compile":
            rows = results["compile"]["by_depth"]
            layers = [r["layers"] for r in rows]
            ax.plot(layers, [r["step_compile_s"] for r in rows], "o-", label="shared branches")
            ax.plot(layers, [r["per_stage_step_compile_s"] for r in rows], "s--",
                    label="a branch per stage")
            ax.set(xlabel="layers ([Dense(64), relu] x n + Dense)", ylabel="step compile s",
                   title="compile time against depth", xscale="log")
            ax.legend()
        elif panel == "cores":
            _cores(ax, results["cores"])
        else:
            for name in ("gpipe", "pipedream", "pb"):
                K = 4
                Ms = np.arange(1, 65)
                ax.plot(Ms, [bubble_formula(name, K, int(M), 1)[0] for M in Ms], label=name)
                ax.plot([r["M"] for r in results["bubbles"] if r["schedule"] == name
                         and r["K"] == K], [r["table_n=1"] for r in results["bubbles"]
                                            if r["schedule"] == name and r["K"] == K], "ko")
            ax.set(xlabel="micro-batches M (K = 4, one step)", ylabel="bubble",
                   title="bubble: closed form (lines), table (dots)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _cores(ax, rows: list[dict]) -> None:
    """The GPT's speed-up over the plain jit alone on one core (medians)
    against M, a line per family at its faster remat of each M."""
    gpt = [r for r in rows if r["model"] == "gpt"]
    for name in dict.fromkeys(r["schedule"] for r in gpt):
        Ms = sorted({r["M"] for r in gpt if r["schedule"] == name})
        best = [max(r["speedup"] for r in gpt if (r["schedule"], r["M"]) == (name, M)) for M in Ms]
        ax.plot(Ms, best, "o-", label=name)
    K = gpt[0]["K"] if gpt else 2
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel=f"micro-batches M (K = {K} pinned processes)", ylabel="speed-up over one core",
           title="zoo GPT on separate cores (faster remat)")
    ax.legend(fontsize=7)
