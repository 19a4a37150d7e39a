"""Step time of the pipelined step against plain `jax.jit` of the same model, alternated."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from pipejax.bench.machine import CLASSES, FEATURES, batch
from pipejax.compile import cast_floating, compute_weights
from pipejax.layers import layer_list
from pipejax.timing import alternate
from pipejax.trace import cost_analysis as cost


def optimizer_step(opt: optax.GradientTransformation) -> Callable:
    """`(weights, state, gradients) -> (weights, state)`: one update, to jit."""
    def update(v, s, g):
        u, s = opt.update(g, s, v)
        return optax.apply_updates(v, u), s
    return update


def plain_steps(layers: list, M: int, opt: optax.GradientTransformation,
                names: tuple[str, ...], loss_fn: Callable = pj.losses.cross_entropy,
                compute_dtype: Any = None) -> dict[str, Callable]:
    """Plain steps `(v, s, x, y) -> (v, s, loss)` of the model and optimizer,
    to jit: `plain_microbatched` sums the gradients of M micro-batches in a
    `lax.scan`, then updates once; `plain_full_batch` updates once on the
    whole batch; `plain_per_microbatch` updates after every micro-batch in
    the scan (what an asynchronous table runs at K = 1, delay 0). With a
    `compute_dtype` the layers compute as a pipeline stage does
    (compile/precision.py): float32 weights and inputs cast to it, the
    outputs cast back to float32 before `loss_fn`."""
    wrapped = layer_list(layers)

    def loss(v, x, y):
        if compute_dtype is None:
            return loss_fn(pj.apply_layers(wrapped, v, x), y)
        out = pj.apply_layers(wrapped, compute_weights(wrapped, v, compute_dtype),
                              cast_floating(x, compute_dtype))
        return loss_fn(cast_floating(out, jnp.float32), y)

    update = optimizer_step(opt)
    split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])

    def microbatched(v, s, x, y):
        def one(acc, xy):
            value, g = jax.value_and_grad(loss)(v, *xy)
            return jax.tree.map(jnp.add, acc, (value, g)), None
        (value, g), _ = jax.lax.scan(one, (jnp.zeros(()), jax.tree.map(jnp.zeros_like, v)),
                                     (split(x), split(y)))
        return *update(v, s, jax.tree.map(lambda a: a / M, g)), value / M

    def full_batch(v, s, x, y):
        value, g = jax.value_and_grad(loss)(v, x, y)
        return *update(v, s, g), value

    def per_microbatch(v, s, x, y):
        def one(vs, xy):
            value, g = jax.value_and_grad(loss)(vs[0], *xy)
            return update(*vs, g), value
        (v, s), values = jax.lax.scan(one, (v, s), (split(x), split(y)))
        return v, s, values.mean()

    steps = {"plain_microbatched": microbatched, "plain_full_batch": full_batch,
             "plain_per_microbatch": per_microbatch}
    return {name: steps[name] for name in names}


def _compare(layers: list, example: jax.Array, M: int, opt: optax.GradientTransformation,
             repeats: int, pipelines: dict[str, dict], plain: tuple[str, ...]) -> dict:
    """Seconds per step of 1-stage pipelined steps (`pipelines`: name ->
    `pj.pipeline` arguments) and of the `plain` jits (`plain_steps`), all
    alternated, from the same initial parameters; XLA's bytes accessed and
    compiled temp bytes of each program."""
    x, y = batch(M * example.shape[0], example.shape[1:])
    trainers, held = {}, {}
    for name, kwargs in pipelines.items():
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=example, stages=1,
                           microbatches=M, **kwargs)
        params = pipe.init(jax.random.key(0))
        trainers[name] = pipe.trainer(opt)
        held[name] = trainers[name].init(params)
    variables = pj.unstage(params)
    steps = {n: jax.jit(f) for n, f in plain_steps(layers, M, opt, plain).items()}
    held.update({n: (variables, opt.init(variables)) for n in steps})

    def runner(name):
        def run():
            if name in trainers:
                held[name], m = trainers[name].step(held[name], (x, y))
                jax.block_until_ready(m["loss"])
            else:
                v, s, value = steps[name](*held[name], x, y)
                held[name] = (v, s)
                jax.block_until_ready(value)
        return run

    t = alternate({n: runner(n) for n in held}, repeats)
    compiled = {n: trainers[n].step.lower(held[n], (x, y)).compile() for n in trainers}
    compiled.update({n: steps[n].lower(*held[n], x, y).compile() for n in steps})
    return {"times": t, "seconds": {n: float(np.median(v)) for n, v in t.items()},
            "bytes_accessed": {n: int(cost(c).get("bytes accessed", 0))
                               for n, c in compiled.items()},
            "temp_bytes": {n: int(c.memory_analysis().temp_size_in_bytes)
                           for n, c in compiled.items()},
            "examples": int(x.shape[0]), "rounds": repeats}


def step_times(layers: list, example: jax.Array, M: int, opt: optax.GradientTransformation,
               repeats: int, remat: str = "none") -> dict:
    """Seconds per step of the 1-stage pipelined step (`remat`) and of
    plain jits of the same model (micro-batched, whole batch), alternated,
    and XLA's bytes accessed by each program."""
    out = _compare(layers, example, M, opt, repeats, {"pipelined": {"remat": remat}},
                   ("plain_microbatched", "plain_full_batch"))
    t = out.pop("times")
    return {**out, "over_microbatched": float(np.median(t["pipelined"] / t["plain_microbatched"])),
            "over_full_batch": float(np.median(t["pipelined"] / t["plain_full_batch"]))}


# The K = 1 comparisons on a CPU: name -> (layers, one micro-batch of inputs, optimizer).
CPU_MODELS = {
    "MLP 8x512, B=256, M=4": (lambda: pj.models.mlp(depth=8, width=512, classes=CLASSES),
                              (64, FEATURES), lambda: optax.sgd(0.01, momentum=0.9)),
    "Transformer 4x256, B=32, M=4": (
        lambda: pj.models.transformer(layers=4, dim=256, heads=4, classes=CLASSES, patch=4),
        (8, 256), lambda: optax.adam(1e-4)),
}


def overhead(repeats: int) -> list[dict]:
    """The 1-stage pipelined step (`remat="none"`) over plain jits of the same
    model: step time and XLA's bytes accessed (targets: both <= 1.05 over
    the micro-batched plain jit)."""
    rows = []
    for name, (layers, shape, opt) in CPU_MODELS.items():
        out = step_times(layers(), jnp.zeros(shape), 4, opt(), repeats)
        s, accessed = out["seconds"], out["bytes_accessed"]
        rows.append({"model": name, "pipelined_ms": round(1e3 * s["pipelined"], 2),
                     "plain_microbatched_ms": round(1e3 * s["plain_microbatched"], 2),
                     "plain_full_batch_ms": round(1e3 * s["plain_full_batch"], 2),
                     "over_microbatched": round(out["over_microbatched"], 3),
                     "bytes_over_microbatched": round(
                         accessed["pipelined"] / accessed["plain_microbatched"], 3),
                     "over_full_batch": round(out["over_full_batch"], 3)})
    return rows


# The asynchronous 1-stage steps: name -> `pj.pipeline` arguments. Without
# weight stashing an asynchronous table needs remat="stage"; at K = 1 both
# tables are fused pairs, which keep nothing and run without it.
ASYNCHRONOUS = {"pipedream": {"schedule": "pipedream", "remat": "stage"},
                "pipedream stash": {"schedule": "pipedream", "remat": "none",
                                    "weight_stashing": True},
                "pb": {"schedule": "pb", "remat": "stage"}}


def asynchronous(repeats: int) -> list[dict]:
    """The 1-stage asynchronous steps over a plain jit that updates after
    every micro-batch (the same updates: delay 0), all alternated in one
    run: step time, XLA's bytes accessed and compiled temp bytes."""
    rows = []
    for model, (layers, shape, opt) in CPU_MODELS.items():
        out = _compare(layers(), jnp.zeros(shape), 4, opt(), repeats, ASYNCHRONOUS,
                       ("plain_per_microbatch",))
        t, s, accessed, temp = (out[k] for k in ("times", "seconds", "bytes_accessed",
                                                 "temp_bytes"))
        plain = "plain_per_microbatch"
        for name in ASYNCHRONOUS:
            rows.append({"model": model, "step": name, "ms": round(1e3 * s[name], 2),
                         "plain_ms": round(1e3 * s[plain], 2),
                         "over_plain": round(float(np.median(t[name] / t[plain])), 3),
                         "bytes_over_plain": round(accessed[name] / accessed[plain], 3),
                         "temp_bytes": temp[name], "plain_temp_bytes": temp[plain]})
    return rows
