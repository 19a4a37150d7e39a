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

Run: python benchmarks/generation.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pipejax as pj
from common import save, table

SIZE = dict(depth=6, width=128, heads=4, context=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=768, help="prompt tokens")
    parser.add_argument("--length", type=int, default=256, help="tokens generated")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each")
    args = parser.parse_args()
    layers = pj.models.gpt(**SIZE)
    h, variables = jnp.zeros((1, SIZE["context"]), jnp.int32), []
    for i, layer in enumerate(layers):
        variables.append(layer.init(jax.random.key(i), h))
        h = layer.apply(variables[-1], h)
    prompt = np.random.default_rng(0).integers(0, 256, args.prompt)
    run = lambda cache: pj.generate(layers, variables, prompt, args.length,
                                    context=SIZE["context"], key=jax.random.key(0),
                                    temperature=0, cache=cache)
    tokens = {cache: run(cache) for cache in (True, False)}  # compiles each program
    same = tokens[True].tolist() == tokens[False].tolist()
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for cache in (True, False):
            start = time.perf_counter()
            run(cache)
            seconds[cache].append(time.perf_counter() - start)
    median = {cache: float(np.median(s)) for cache, s in seconds.items()}
    rows = [{"cache": cache, "seconds": f"{median[cache]:.2f}",
             "tokens/s": f"{args.length / median[cache]:.1f}"} for cache in (True, False)]
    ratio = median[False] / median[True]
    print(table(rows))
    print(f"context {SIZE['context']}, prompt {args.prompt}, {args.length} tokens generated; "
          f"median of {args.rounds}; cache {ratio:.1f}x faster; greedy tokens equal: {same}")
    path = save("generation", {**SIZE, "prompt": args.prompt, "length": args.length,
                               "rounds": args.rounds, "seconds": {str(k): v for k, v in
                                                                  seconds.items()},
                               "tokens_per_s": {str(c): args.length / median[c]
                                                for c in (True, False)},
                               "speedup": ratio, "greedy_tokens_equal": same, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
