"""What an NNX layer list costs against the same model in linen.

pipejax splits each NNX module once (graphdef, parameters, streams,
constants) and merges a throwaway copy inside its stage branch, at trace
time: XLA should see the linen model's program. MaxText's NNX pipeline
reports that the wrong way to thread NNX state through a transform
(`nnx.vmap` inside its scan) cost 6.3x the compile-time temp memory; this
measures ours. For every zoo model and its NNX twin (`api="nnx"`), on
MNIST-1D shapes, K = 4 GPipe, M = 4 micro-batches of 16, Adam:

- the partition each API gets (the twins have the same layer costs);
- seconds to build the pipeline (trace, cost analysis, partition) and to
  compile `trainer.step`;
- the compiled step's temp bytes (`memory_analysis`);
- the step time, the two APIs timed in alternating rounds of one run.

Run: python benchmarks/nnx_twins.py [--rounds N]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pipejax as pj
from common import load, markdown, save, table

K, M, MB, L = 4, 4, 16, 40
MODELS = {  # the CLI's default sizes for MNIST-1D (pipejax/cli/models.py)
    "mlp": lambda **kw: [pj.models.common.flatten] + pj.models.mlp(4, 256, **kw),
    "snn": lambda **kw: pj.models.snn(16, 64, **kw),
    "resnet": lambda **kw: pj.models.resnet(6, 32, **kw),
    "vgg": lambda **kw: pj.models.vgg(**kw),
    "transformer": lambda **kw: pj.models.transformer(4, 64, 4, **kw),
    "residual_lstm": lambda **kw: pj.models.residual_lstm(3, 64, **kw),
}


def _run(build, api: str) -> dict:
    """Build, compile and run one step of `build` in `api`; the numbers and
    a `step()` that runs one more step on the trainer's own state."""
    layers = build() if api == "linen" else build(api="nnx", inputs=(L,), rngs=nnx.Rngs(0))
    start = time.perf_counter()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, L)),
                       stages=K, microbatches=M)
    built = time.perf_counter() - start
    trainer = pipe.trainer(optax.adam(1e-3))
    box = [trainer.init(pipe.init(jax.random.key(0)))]
    x = jax.random.normal(jax.random.key(1), (M * MB, L))
    y = jax.random.randint(jax.random.key(2), (M * MB,), 0, 10)
    start = time.perf_counter()
    compiled = trainer.step.lower(box[0], (x, y)).compile()
    compile_s = time.perf_counter() - start

    def step() -> float:
        start = time.perf_counter()
        box[0], metrics = trainer.step(box[0], (x, y))
        jax.block_until_ready(metrics["loss"])
        return time.perf_counter() - start

    step()  # the first call
    return {"split": list(pipe.plan.split), "build_s": built, "compile_s": compile_s,
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes), "step": step}


def tables() -> dict[str, str]:
    """The NNX page's table, from nnx_twins.json."""
    return {"rows": markdown(load("nnx_twins")["rows"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per API and model")
    args = parser.parse_args()
    _run(MODELS["mlp"], "linen")  # JAX's own start-up, before anything is timed
    rows, results = [], {}
    for name, build in MODELS.items():
        runs = {api: _run(build, api) for api in ("linen", "nnx")}
        times = {"linen": [], "nnx": []}
        for _ in range(args.rounds):  # alternating, so both see the same machine
            for api in ("linen", "nnx"):
                times[api].append(runs[api]["step"]())
        ms = {api: 1e3 * float(np.median(t)) for api, t in times.items()}
        result = {api: {**{k: v for k, v in runs[api].items() if k != "step"},
                        "step_ms": ms[api]} for api in runs}
        results[name] = result
        lin, twin = result["linen"], result["nnx"]
        rows.append({"model": name, "split linen / nnx": f"{lin['split']} / {twin['split']}",
                     "build s": f"{lin['build_s']:.2f} / {twin['build_s']:.2f}",
                     "compile s": f"{lin['compile_s']:.2f} / {twin['compile_s']:.2f}",
                     "temp bytes nnx/linen": f"{twin['temp_bytes'] / lin['temp_bytes']:.3f}",
                     "step ms": f"{lin['step_ms']:.2f} / {twin['step_ms']:.2f}",
                     "step nnx/linen": f"{twin['step_ms'] / lin['step_ms']:.3f}"})
    print(table(rows))
    print(f"K={K} GPipe, M={M} micro-batches of {MB}, Adam; median of {args.rounds} alternating "
          "rounds; 'a / b' is linen / nnx")
    path = save("nnx_twins", {"K": K, "M": M, "microbatch": MB, "rounds": args.rounds,
                              "rows": rows, "models": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
