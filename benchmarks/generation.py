"""Tokens per second of `pj.generate` with a key/value cache against recomputing the window.

The zoo GPT at the training job's size (depth 6, width 128, 4 heads, byte
vocabulary) with a context of 1024, random weights, on one CPU device: a
prompt of `--prompt` tokens followed by `--length` generated ones, so the
text fills the context and every recomputed window is 1024 positions long.
`cache=True` feeds the prompt and each new token one position at a time
through the layers' caches; `cache=False` runs the whole window at every
token. Both programs are compiled first (one untimed call each); then the
two are timed in alternating rounds of one run, and the greedy tokens are
checked equal. Tokens per second count the generated tokens only (the
cached run also spends its time feeding the prompt through the cache).

Both APIs: the zoo GPT in linen and in NNX (`api="nnx"`), whose compiled
program `pj.generate` keeps between calls as linen's. Whether a call
compiles again shows where compiling dominates: three calls of 128 tokens
after a prompt of 4 (caches cleared first), the later calls' share of the
first in the JSON (`calls_later_over_first`).

Run: python benchmarks/generation.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pipejax as pj
from common import RESULTS, load, save, table

SIZE = dict(depth=6, width=128, heads=4, context=1024)


def measure(api: str, prompt: np.ndarray, length: int, rounds: int) -> dict:
    """Seconds of each call of `pj.generate` with and without a cache, the
    first (compiling) call of each first, then `rounds` alternating ones."""
    rngs = nnx.Rngs(0) if api == "nnx" else None
    layers = pj.models.gpt(**SIZE, api=api, rngs=rngs)
    window = jnp.zeros((1, SIZE["context"]), jnp.int32)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=window, targets=window,
                       stages=1, microbatches=1)
    variables = pj.unstage(pipe.init(jax.random.key(0)))
    tokens, seconds = {}, {True: [], False: []}

    def run(cache: bool) -> None:
        start = time.perf_counter()
        tokens[cache] = pj.generate(layers, variables, prompt, length, context=SIZE["context"],
                                    key=jax.random.key(0), temperature=0, cache=cache)
        seconds[cache].append(time.perf_counter() - start)

    pj.clear_caches()
    jax.clear_caches()
    calls = []
    for _ in range(3):  # compiling dominates: a short prompt, 128 tokens
        start = time.perf_counter()
        pj.generate(layers, variables, prompt[:4], 128, context=SIZE["context"],
                    key=jax.random.key(0))
        calls.append(time.perf_counter() - start)
    for cache in (True, False):
        run(cache)  # compiles
    for _ in range(rounds):
        for cache in (True, False):
            run(cache)
    median = {cache: float(np.median(s[1:])) for cache, s in seconds.items()}
    return {"api": api, "seconds": {str(c): s for c, s in seconds.items()},
            "tokens_per_s": {str(c): length / median[c] for c in (True, False)},
            "calls": calls, "calls_later_over_first": max(calls[1:]) / calls[0],
            "speedup": median[False] / median[True],
            "greedy_tokens_equal": tokens[True].tolist() == tokens[False].tolist()}


def tables() -> dict[str, str]:
    """The language-model page's sentence on generation, both APIs."""
    if not (RESULTS / "generation.json").exists():
        return {"sentence": ""}
    data = load("generation")
    by = {r["api"]: r for r in data["apis"]}
    linen, nnx_row = by["linen"], by["nnx"]
    rate = lambda r, c: f"{r['tokens_per_s'][str(c)]:.1f}"
    first = lambda r: f"{r['calls'][0]:.2f} s"
    later = lambda r: f"{max(r['calls'][1:]):.3f} s"
    return {"sentence": (
        f"`python benchmarks/generation.py` (`benchmarks/results/generation.json`): the zoo GPT "
        f"at depth {data['depth']}, width {data['width']} and a context of {data['context']}, a "
        f"prompt of {data['prompt']} tokens and {data['length']} generated, greedy, on one CPU "
        f"device of the 2-core machine: {rate(linen, True)} tokens per second with the cache, "
        f"{rate(linen, False)} recomputing the window, **{linen['speedup']:.1f}×** in linen; "
        f"{rate(nnx_row, True)} and {rate(nnx_row, False)}, **{nnx_row['speedup']:.1f}×**, "
        f"in NNX (median of {data['rounds']} alternating calls after the first; the cached "
        f"call's time includes feeding the prompt through the caches), the same tokens "
        f"{'in both' if all(r['greedy_tokens_equal'] for r in data['apis']) else 'NOT always'}. "
        f"The program is compiled once per setting, in NNX as in linen: of three calls of 128 "
        f"tokens after a prompt of 4, the first takes {first(linen)} in linen and "
        f"{first(nnx_row)} in NNX, a later one at most {later(linen)} and {later(nnx_row)}.")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=768, help="prompt tokens")
    parser.add_argument("--length", type=int, default=256, help="tokens generated")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each")
    args = parser.parse_args()
    prompt = np.random.default_rng(0).integers(0, 256, args.prompt)
    results = [measure(api, prompt, args.length, args.rounds) for api in ("linen", "nnx")]
    rows = [{"api": r["api"], "cache": c, "first s": f"{r['seconds'][str(c)][0]:.2f}",
             "later s": f"{np.median(r['seconds'][str(c)][1:]):.2f}",
             "tokens/s": f"{r['tokens_per_s'][str(c)]:.1f}"}
            for r in results for c in (True, False)]
    print(table(rows))
    for r in results:
        print(f"{r['api']}: cache {r['speedup']:.1f}x faster; greedy tokens equal: "
              f"{r['greedy_tokens_equal']}; 3 calls of 128 tokens: "
              + ", ".join(f"{c:.3f}" for c in r["calls"]) + " s")
    path = save("generation", {**SIZE, "prompt": args.prompt, "length": args.length,
                               "rounds": args.rounds, "apis": results, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
