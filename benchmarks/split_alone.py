"""Zero bubble's split compiled alone: B and W against the fused backward.

A zero-bubble step runs each stage's backward as B (the input gradient,
and the bridge it files for W) and W (the weight gradients from the
bridge); 1F1B runs it as one vjp (BW). Here each runs compiled alone on
concrete inputs, with no ring and no tick around it, on one core (so that
a row's time is its work): BW, B, W, and B then W in one program (B∘W),
alternated. The zoo GPT of `table_speed.py` (depth 14, width 128, 4 heads,
context 128; micro-batches of 4 windows) at K = 4, the first stage and a
middle one (the last runs its forward inside B), remat "stage" and
"none". Set beside `table_speed_one_core.json` (the same stages in their
tables, on one core), this separates the split's own cost from what the
rings add (docs/language-models.md).
Run: python benchmarks/split_alone.py [--repeats 20]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
from common import RESULTS, load, save, table
from pipejax.compile import split_functions
from pipejax.timing import alternate
from pipejax.trace import cost_analysis

K, WINDOWS, CONTEXT, WIDTH = 4, 4, 128, 128


def _concrete(abstract: Any) -> Any:
    """Arrays of `abstract`'s shapes and dtypes: small normal floats, zero
    integers (token ids), keys."""
    leaves, tree = jax.tree.flatten(abstract)
    out = []
    for i, a in enumerate(leaves):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            out.append(jax.random.split(jax.random.key(i), a.shape) if a.shape
                       else jax.random.key(i))
        elif jnp.issubdtype(a.dtype, jnp.floating):
            out.append(0.1 * jax.random.normal(jax.random.key(i), a.shape, a.dtype))
        else:
            out.append(jnp.zeros(a.shape, a.dtype))
    return jax.tree.unflatten(tree, out)


def _op(fn: Callable, args: tuple) -> tuple[Callable[[], None], dict]:
    """A call of `fn` compiled on `args`, blocked on, and XLA's cost analysis."""
    compiled = jax.jit(fn).lower(*args).compile()
    return (lambda: jax.block_until_ready(compiled(*args))), cost_analysis(compiled)


def stage(remat: str, j: int, repeats: int) -> dict:
    """BW, B, W and B∘W of virtual stage j of the GPT at K = 4, alternated."""
    tokens = jnp.zeros((WINDOWS, CONTEXT), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=14, width=WIDTH, heads=4, context=CONTEXT),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=K,
                       microbatches=8, schedule="zb-h1", remat=remat)
    code = pipe.build.code
    args = jax.tree.leaves(_concrete(code.backward_args(j)))
    tree = jax.tree.structure(code.backward_args(j))
    split = code.splits[code.groups.of[j]]
    (b, _), (w, _) = split_functions(code, j)
    bridge = jax.jit(b)(*args)[1]
    reread = [args[i] for i in split.reread]

    def both(*a):
        grads_in, filed = split.run_b(a)
        return split.run_w([a[i] for i in split.reread], filed), grads_in
    ops = {"BW": _op(lambda *a: code.backward(j, *jax.tree.unflatten(tree, a)), args),
           "B": _op(b, args), "W": _op(w, (reread, bridge)), "B∘W": _op(both, args)}
    times = alternate({name: run for name, (run, _) in ops.items()}, repeats)
    ratio = lambda name: round(float(np.median(times[name] / times["BW"])), 3)
    return {"remat": remat, "stage": j, "bridge_values": len(bridge),
            "bridge_mb": round(sum(a.nbytes for a in bridge) / 2**20, 2),
            **{f"{name}_ms": round(float(np.median(times[name])) * 1e3, 2) for name in ops},
            "B+W_over_BW": round(float(np.median((times["B"] + times["W"]) / times["BW"])), 3),
            "B∘W_over_BW": ratio("B∘W"),
            **{f"{name}_gb": round(cost.get("bytes accessed", 0.0) / 1e9, 3)
               for name, (_, cost) in ops.items()}}


def tables() -> dict[str, str]:
    """The language-model page's sentence on the split compiled alone."""
    if not (RESULTS / "split_alone.json").exists():
        return {"sentence": ""}
    rows = load("split_alone")["rows"]
    span = lambda key: (f"{min(r[key] for r in rows):.2f}–{max(r[key] for r in rows):.2f}")
    mb = lambda remat: max(r["bridge_mb"] for r in rows if r["remat"] == remat)
    return {"sentence": (
        f"Compiled alone, on one core, with no ring around them (`python "
        f"benchmarks/split_alone.py`: the GPT above at K = 4, its first and a middle stage, "
        f"both remats), B and then W take {span('B+W_over_BW')}× the fused backward's time, "
        f"and {span('B∘W_over_BW')}× as one program: the split itself costs no time. "
        f"The bridge B files is {mb('stage'):.1f} MiB a micro-batch with remat \"stage\" and "
        f"{mb('none'):.1f} MiB with \"none\" (a stage's input, what 1F1B keeps with "
        f"\"stage\", {WINDOWS * CONTEXT * WIDTH * 4 / 2**20:.2f} MiB).")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    # One core, before JAX starts its threads: a row's time is its work.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
    rows = []
    for remat in ("stage", "none"):
        for j in (0, 1):
            rows.append(stage(remat, j, args.repeats))
            print(rows[-1], flush=True)
    print(table(rows))
    save("split_alone", {"model": "gpt depth 14 width 128", "K": K, "microbatch": WINDOWS,
                         "cores": 1, "rows": rows})


if __name__ == "__main__":
    main()
