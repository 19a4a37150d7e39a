"""The GPU section: the zoo GPT's training step on an accelerator, pipelined
and as a plain `jax.jit`, in bf16 (float32 master weights) and float32.

Rows, those of one group (a compute dtype on a vocabulary) alternated in one
process (`alternate`), in the order they are compiled (a budget that runs
out leaves out the last):
  plain jit                  the layer list's loss and AdamW update in one
                             `jax.jit`, the gradients of M micro-batches
                             summed in a `lax.scan`, weights cast as a
                             pipeline stage casts them: the limit;
  1f1b K = 1                 the pipelined step on one device, remat "none"
                             and "stage";
  1f1b K = 2, 4, 8           where the machine has the devices (M = 2K);
  gpipe K = 1                remat "none" and "stage";
  plain jit per micro-batch  a plain jit that updates after every
                             micro-batch, the limit of
  pb                         pipelined backpropagation on one device (delay
                             0: the same updates);
  zb-h1 K = 1                zero bubble's B and W split of the same step,
                             read against 1F1B at the same remat: what the
                             split and its B→W bridge cost on the device.
A last group runs the plain jit and 1F1B at K = 1 in bf16 on a language
model's vocabulary (`lm_vocab`, random tokens): the head then holds over a
quarter of the FLOPs (GPT-2 small: 27 %), as in the models a user compares with.
Per row: the median step time, tokens/s, model FLOP utilisation per device
against its dense peak for the compute dtype (`PEAKS`), XLA's bytes
accessed, the compiled peak memory (arguments + outputs − donated + temp)
and the compile time; a K = 1 row also its time, bytes and MFU over its
limit's (the median of the rounds' paired ratios). The model's FLOPs are
`pj.trace`'s count (XLA's CPU cost analysis of each layer's forward and
backward; a GPU's analysis leaves out the matrix products, which are
library calls there).

The section aims at `budget` seconds of wall time, compiles included: each
group has a share by its rows, compiles no row once 80 % of its share has passed
(a compile under way finishes) and stops its timed rounds at the share's end
(after three warm-up and three timed rounds at least).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from pipejax.bench.gpu_rows import FULL, SMOKE, Group, Size, Step, groups, steps
from pipejax.bench.memory import peak_bytes
from pipejax.bench.speed import cost, plain_steps
from pipejax.timing import alternate

BUDGET = 390.0  # seconds: every row at H100 compile times; a run and a start fit 15 minutes

# Dense peak FLOP/s of one device per compute dtype; the first key found in
# the device's kind applies (an empty dict: a kind whose peak is not stated
# here, e.g. the H100 NVL, gets no MFU rather than another card's). float32
# matrix products run as TF32 under JAX's default precision: its peak is TF32's.
PEAKS = (("H100 PCIe", {"bfloat16": 756.0e12, "float32": 378.0e12}),
         ("H100 NVL", {}),
         ("H100", {"bfloat16": 989.4e12, "float32": 494.7e12}),
         ("H200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
         ("A100", {"bfloat16": 312.0e12, "float32": 156.0e12}))


def peak_flops(kind: str, dtype: str) -> float | None:
    """The device's dense peak for `dtype`, or None if `PEAKS` lacks it."""
    return next((peaks.get(dtype) for key, peaks in PEAKS if key in kind), None)


@functools.cache
def traced(size: Size) -> tuple[float, int]:
    """Forward + backward FLOPs of one micro-batch and the parameters, summed
    over the layers as `pj.trace` counts them on the CPU."""
    example = jnp.zeros((size.micro, size.context), jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        specs = pj.trace(size.layers(), example)
    return (float(sum(s.flops or 0.0 for s in specs)),
            sum(x.size for s in specs for x in jax.tree.leaves(s.variables)))


@dataclasses.dataclass
class Row:
    """One compiled step, ready to run."""

    step: Step
    M: int
    run: Callable[[], None]
    compiled: Any
    compile_s: float


def _tokens(size: Size, M: int) -> tuple[jax.Array, jax.Array]:
    shape = (M * size.micro, size.context)
    return (jax.random.randint(jax.random.key(1), shape, 0, size.vocab),
            jax.random.randint(jax.random.key(2), shape, 0, size.vocab))


def _timed_compile(lowered) -> tuple[Any, float]:
    began = time.perf_counter()
    return lowered.compile(), time.perf_counter() - began


def _pipelined(step: Step, size: Size, dtype: Any, opt: optax.GradientTransformation) -> Row:
    """A compiled pipelined step of the GPT over `step.K` devices."""
    M = step.M or size.M
    x, y = _tokens(size, M)
    pipe = pj.pipeline(size.layers(), loss=pj.losses.next_token, example=x[:size.micro],
                       targets=y[:size.micro], stages=step.K, microbatches=M,
                       compute_dtype=dtype, **step.pipeline)
    trainer = pipe.trainer(opt)
    state = [trainer.init(pipe.init(jax.random.key(0)))]
    compiled, seconds = _timed_compile(trainer.step.lower(state[0], (x, y)))

    def run():
        state[0], metrics = compiled(state[0], (x, y))
        jax.block_until_ready(metrics["loss"])
    return Row(step, M, run, compiled, seconds)


def _plain(step: Step, size: Size, dtype: Any, variables: list,
           opt: optax.GradientTransformation) -> Row:
    """A compiled plain jit of the GPT, its state donated as the pipelined
    step donates its own."""
    x, y = _tokens(size, size.M)
    fn = plain_steps(size.layers(), size.M, opt, (step.plain,), pj.losses.next_token,
                     dtype)[step.plain]
    variables = jax.tree.map(jnp.copy, variables)  # each row donates its own
    held = [(variables, opt.init(variables))]
    compiled, seconds = _timed_compile(jax.jit(fn, donate_argnums=(0, 1)).lower(*held[0], x, y))

    def run():
        v, s, value = compiled(*held[0], x, y)
        held[0] = (v, s)
        jax.block_until_ready(value)
    return Row(step, size.M, run, compiled, seconds)


def _steps(group: Group) -> dict[str, Step]:
    """The group's rows, in the order they are compiled."""
    every = steps(len(jax.devices()), group.size)
    return {n: s for n, s in every.items() if group.rows is None or n in group.rows}


def _group(group: Group, opt: optax.GradientTransformation, compile_by: float,
           deadline: float, strict: bool) -> list[dict]:
    """Compile the rows while time is left before `compile_by`, time them
    alternated until `deadline`; the plain jits start from the layers'
    initial variables, the pipelines from their own init. A row that fails
    to build or run records its error and the others go on, unless `strict`
    (the smoke run: a failure there is a bug, raised)."""
    size, dtype = group.size, jnp.dtype(group.dtype)
    variables = pj.layers.initial_variables(size.layers(), _tokens(size, 1)[0],
                                            jax.random.key(0))
    built, failed = {}, []
    for name, step in _steps(group).items():
        if time.perf_counter() > compile_by:
            failed.append({"step": name, "error": "left out: the section's budget ran out"})
            continue
        try:
            if step.pipeline is None:
                row = _plain(step, size, dtype, variables, opt)
            else:
                row = _pipelined(step, size, dtype, opt)
            row.run()  # a step that cannot run (out of memory) fails here
            built[name] = row
        except Exception as e:  # a GPU run keeps what it can measure and says why not
            if strict:
                raise
            failed.append({"step": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    if not built:
        return failed
    times = alternate({n: r.run for n, r in built.items()}, size.repeats, deadline)
    rows = {n: _figures(n, r, times[n], size, dtype) for n, r in built.items()}
    for name, row in built.items():
        against = row.step.against
        if against in rows:
            rows[name].update(_over(times[name], times[against], rows[name], rows[against],
                                    row.step.limit))
    return list(rows.values()) + failed


def _figures(name: str, row: Row, seconds: np.ndarray, size: Size, dtype: Any) -> dict:
    """A row's step time, throughput, MFU per device, bytes, memory and compile time."""
    median = float(np.median(seconds))
    peak = peak_flops(jax.devices()[0].device_kind, jnp.dtype(dtype).name)
    achieved = row.M * traced(size)[0] / median / row.step.K
    return {"step": name, "K": row.step.K, "M": row.M, "ms": round(1e3 * median, 2),
            "tokens_per_s": round(row.M * size.micro * size.context / median),
            "model_tflops": round(achieved / 1e12, 1),
            "mfu": None if peak is None else round(achieved / peak, 4),
            "gb_accessed": _digits(cost(row.compiled).get("bytes accessed", 0) / 1e9),
            "peak_gb": _digits(peak_bytes(row.compiled) / 1e9),
            "compile_s": round(row.compile_s, 1), "rounds": len(seconds)}


def _digits(x: float) -> float:
    """`x` to four significant digits (a tiny smoke run's bytes too)."""
    return float(f"{x:.4g}")


def _over(mine: np.ndarray, theirs: np.ndarray, row: dict, limit: dict, name: str) -> dict:
    """A K = 1 row over its limit (`name`: "plain" or a schedule): the median
    of the rounds' paired time ratios, the bytes accessed and the MFU (the
    inverse time ratio)."""
    ratio = float(np.median(mine / theirs))
    return {f"over_{name}": round(ratio, 3), f"mfu_over_{name}": round(1 / ratio, 3),
            f"bytes_over_{name}": round(row["gb_accessed"] / limit["gb_accessed"], 3)
            if limit["gb_accessed"] else None}


def gpu(smoke: bool = False, budget: float = BUDGET) -> dict:
    """The section's rows per group, with the model, its FLOP count and the
    peaks used (see the module's docstring)."""
    size = SMOKE if smoke else FULL
    start = time.perf_counter()
    opt = optax.adamw(3e-4, weight_decay=0.1)
    kind = jax.devices()[0].device_kind
    flops, parameters = traced(size)
    result = {"model": {**dataclasses.asdict(size), "parameters": parameters},
              "flops_per_step": size.M * flops, "device_kind": kind,
              "peaks": {d: peak_flops(kind, d) for d in ("bfloat16", "float32")}}
    if size.lm_vocab is not None:
        lm_flops, lm_parameters = traced(dataclasses.replace(size, vocab=size.lm_vocab))
        result["lm"] = {"vocab": size.lm_vocab, "parameters": lm_parameters,
                        "flops_per_step": size.M * lm_flops}
    every = groups(size)
    rows = np.array([len(_steps(g)) for g in every], float)
    ends = start + budget * np.cumsum(rows) / rows.sum()  # a share of the budget a row
    for group, end, share in zip(every, ends, budget * rows / rows.sum()):
        result[group.key] = _group(group, opt, end - 0.2 * share, end, strict=smoke)
    return {**result, "seconds": round(time.perf_counter() - start, 1), "budget_s": budget}
