"""The GPU section: the zoo GPT's training step on an accelerator, pipelined
and as a plain `jax.jit`, in bf16 (float32 master weights) and float32.

Rows, all of one compute dtype alternated in one process (`alternate`):
  plain jit            the layer list's loss and AdamW update in one `jax.jit`,
                       the gradients of M micro-batches summed in a `lax.scan`,
                       weights cast as a pipeline stage casts them: the limit;
  gpipe / 1f1b K = 1   the pipelined step on one device, remat "none" and "stage";
  plain per-mb         a plain jit that updates after every micro-batch, and
  pb K = 1             pipelined backpropagation on one device (delay 0: the
                       same updates);
  1f1b K = 2, 4, 8     when the machine has that many devices (M = 2K).
Per row: the median step time, tokens/s, model FLOP utilisation against the
device's dense peak for the compute dtype (`PEAKS`), XLA's bytes accessed,
the compiled peak memory (arguments + outputs - donated + temp) and the
compile time. The model's FLOPs are `pj.trace`'s count (XLA's CPU cost
analysis of each layer's forward and backward; a GPU's analysis leaves out
the matrix products, which are library calls there).

The whole section runs within `budget` seconds of wall time, compiles
included: a row is not compiled once 80 % of it has passed, the timed rounds
stop at it, and the rows it has measured are what it returns.
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
from pipejax.errors import ConfigError
from pipejax.bench.memory import peak_bytes
from pipejax.bench.speed import alternate, cost, plain_steps

# Dense peak FLOP/s of one device per compute dtype; the first key found in
# the device's kind applies. float32 matrix products run as TF32 on these
# GPUs under JAX's default precision, so float32's peak is the TF32 rate.
PEAKS = (("H100 PCIe", {"bfloat16": 756.0e12, "float32": 378.0e12}),
         ("H100", {"bfloat16": 989.4e12, "float32": 494.7e12}),
         ("H200", {"bfloat16": 989.4e12, "float32": 494.7e12}),
         ("A100", {"bfloat16": 312.0e12, "float32": 156.0e12}))


@dataclasses.dataclass(frozen=True)
class Size:
    """The GPT and its batch: `micro` sequences of `context` tokens a
    micro-batch, M micro-batches a step."""

    depth: int
    width: int
    heads: int
    context: int
    vocab: int
    micro: int
    M: int
    repeats: int
    max_stages: int  # the deepest 1f1b row, when the machine has the devices
    dtypes: tuple[str, ...] = ("bfloat16", "float32")  # compute dtypes, one group each

    def layers(self) -> list:
        return pj.models.gpt(self.depth, self.width, self.heads, self.context, self.vocab)

    def flops(self) -> float:
        """Forward + backward FLOPs of one micro-batch (`model_flops`)."""
        return _traced(self)[0]

    def parameters(self) -> int:
        return _traced(self)[1]


@functools.cache
def _traced(size: Size) -> tuple[float, int]:
    example = jnp.zeros((size.micro, size.context), jnp.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        specs = pj.trace(size.layers(), example)
    return (float(sum(s.flops or 0.0 for s in specs)),
            sum(x.size for s in specs for x in jax.tree.leaves(s.variables)))


# GPT-2 small's blocks (12 x 768, 12 heads, 1024 tokens) over bytes: 85 M
# parameters in the blocks. 8 sequences a micro-batch (8192 tokens) keep one
# micro-batch's float32 activations near 20 GB, within any 40 GB device.
FULL = Size(depth=12, width=768, heads=12, context=1024, vocab=256, micro=8, M=4, repeats=20,
            max_stages=8)
# A GPT a CPU steps in milliseconds: every row's code path between GPU runs
# (float32 runs the same code as bf16, with another dtype).
SMOKE = Size(depth=2, width=32, heads=2, context=16, vocab=64, micro=2, M=2, repeats=2,
             max_stages=2, dtypes=("bfloat16",))

# name -> (`pj.pipeline` arguments at K = 1, or None for a plain jit; the
# plain step it is timed against). In the order rows are compiled: a budget
# that runs out leaves out the last.
SYNCHRONOUS = {"plain jit": None,
               "1f1b remat=none": {"schedule": "1f1b", "remat": "none"},
               "1f1b remat=stage": {"schedule": "1f1b", "remat": "stage"},
               "gpipe remat=none": {"schedule": "gpipe", "remat": "none"},
               "gpipe remat=stage": {"schedule": "gpipe", "remat": "stage"}}
ASYNCHRONOUS = {"plain jit per micro-batch": None, "pb": {"schedule": "pb", "remat": "stage"}}
LIMITS = {"plain jit": "plain_microbatched", "plain jit per micro-batch": "plain_per_microbatch"}


def peak_flops(kind: str, dtype: str) -> float | None:
    """The device's dense peak for `dtype`, or None if `PEAKS` lacks it."""
    return next((peaks[dtype] for key, peaks in PEAKS if key in kind), None)


@dataclasses.dataclass
class Row:
    """One compiled step, its state and its figures."""

    name: str
    K: int
    M: int
    run: Callable[[], None]
    compiled: Any
    compile_s: float


def _tokens(size: Size, M: int) -> tuple[jax.Array, jax.Array]:
    shape = (M * size.micro, size.context)
    return (jax.random.randint(jax.random.key(1), shape, 0, size.vocab),
            jax.random.randint(jax.random.key(2), shape, 0, size.vocab))


def _pipelined(name: str, size: Size, dtype: Any, K: int, M: int, kwargs: dict,
               opt: optax.GradientTransformation) -> Row:
    """A compiled pipelined step of the GPT over K devices."""
    x, y = _tokens(size, M)
    pipe = pj.pipeline(size.layers(), loss=pj.losses.next_token, example=x[:size.micro],
                       targets=y[:size.micro], stages=K, microbatches=M,
                       mesh=pj.make_mesh(K, devices=jax.devices()[:K]), compute_dtype=dtype,
                       **kwargs)
    trainer = pipe.trainer(opt)
    state = [trainer.init(pipe.init(jax.random.key(0)))]
    began = time.perf_counter()
    compiled = trainer.step.lower(state[0], (x, y)).compile()
    seconds = time.perf_counter() - began

    def run():
        state[0], metrics = compiled(state[0], (x, y))
        jax.block_until_ready(metrics["loss"])
    return Row(name, K, M, run, compiled, seconds)


def _plain(name: str, size: Size, dtype: Any, variables: list,
           opt: optax.GradientTransformation) -> Row:
    """A compiled plain jit of the GPT (`LIMITS[name]`), its state donated
    as the pipelined step donates its own."""
    x, y = _tokens(size, size.M)
    step = plain_steps(size.layers(), size.M, opt, (LIMITS[name],), pj.losses.next_token,
                       dtype)[LIMITS[name]]
    variables = jax.tree.map(jnp.copy, variables)  # each row donates its own
    held = [(variables, opt.init(variables))]
    began = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*held[0], x, y).compile()
    seconds = time.perf_counter() - began

    def run():
        v, s, value = compiled(*held[0], x, y)
        held[0] = (v, s)
        jax.block_until_ready(value)
    return Row(name, 1, size.M, run, compiled, seconds)


def _variables(size: Size) -> list:
    """The GPT's initial variables, as a 1-stage pipeline initializes them."""
    x, y = _tokens(size, 1)
    return pj.unstage(pj.pipeline(size.layers(), loss=pj.losses.next_token, example=x,
                                  targets=y, stages=1, microbatches=1).init(jax.random.key(0)))


def _group(rows: dict, size: Size, dtype: Any, opt: optax.GradientTransformation,
           compile_by: float, deadline: float) -> list[dict]:
    """Compile `rows` (name -> pipeline arguments with K and M, or None for
    a plain jit) while time is left before `compile_by`, time them
    alternated until `deadline`; a row that fails records its error."""
    built, failed, variables = {}, [], None
    for name, kwargs in rows.items():
        if time.perf_counter() > compile_by:
            failed.append({"step": name, "error": "left out: the section's budget ran out"})
            continue
        try:
            if kwargs is None:
                variables = variables or _variables(size)
                row = _plain(name, size, dtype, variables, opt)
            else:
                kwargs = dict(kwargs)
                K, M = kwargs.pop("K", 1), kwargs.pop("M", size.M)
                row = _pipelined(name, size, dtype, K, M, kwargs, opt)
            row.run()  # a step that cannot run (out of memory) fails here
            built[name] = row
        except Exception as e:  # a row that cannot build or run says why; the others go on
            failed.append({"step": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    if not built:
        return failed
    times = alternate({n: r.run for n, r in built.items()}, size.repeats, deadline)
    return [_figures(r, times[n], size, dtype) for n, r in built.items()] + failed


def _figures(row: Row, seconds: np.ndarray, size: Size, dtype: Any) -> dict:
    """A row's step time, throughput, MFU, bytes, memory and compile time."""
    tokens = row.M * size.micro * size.context
    median = float(np.median(seconds))
    peak = peak_flops(jax.devices()[0].device_kind, jnp.dtype(dtype).name)
    achieved = row.M * size.flops() / median / row.K  # per device
    return {"step": row.name, "K": row.K, "M": row.M, "ms": round(1e3 * median, 2),
            "tokens_per_s": round(tokens / median), "model_tflops": round(achieved / 1e12, 1),
            "mfu": None if peak is None else round(achieved / peak, 4),
            "gb_accessed": round(cost(row.compiled).get("bytes accessed", 0) / 1e9, 2),
            "peak_gb": round(peak_bytes(row.compiled) / 1e9, 2),
            "compile_s": round(row.compile_s, 1), "rounds": len(seconds)}


def gpu(smoke: bool = False, budget: float = 240.0) -> dict:
    """The section's rows per compute dtype, with the model, its FLOP count
    and the peaks used (see the module's docstring): bf16 first, by 55 % of
    the budget, then float32."""
    size = SMOKE if smoke else FULL
    start = time.perf_counter()
    opt = optax.adamw(3e-4, weight_decay=0.1)
    deeper = {f"1f1b K={K}": {"schedule": "1f1b", "remat": "stage", "K": K, "M": 2 * K}
              for K in (2, 4, 8) if K <= min(len(jax.devices()), size.max_stages)}
    rows = {**SYNCHRONOUS, **ASYNCHRONOUS, **deeper}
    kind = jax.devices()[0].device_kind
    result = {"model": {**dataclasses.asdict(size), "parameters": size.parameters()},
              "flops_per_step": size.M * size.flops(), "device_kind": kind,
              "peaks": {d: peak_flops(kind, d) for d in ("bfloat16", "float32")}}
    for dtype in size.dtypes:
        share = 0.55 if dtype == "bfloat16" and len(size.dtypes) > 1 else 1.0
        result[dtype] = _group(rows, size, jnp.dtype(dtype), opt, start + 0.8 * share * budget,
                               start + share * budget)
    return {**result, "seconds": round(time.perf_counter() - start, 1)}


def measured_flops(result: dict, dtype: str = "bfloat16") -> tuple[float, str]:
    """The plain jit's model FLOP/s in `dtype` from a `bench_gpu.json`
    (`result`), and the device it ran on: the device rate `pj.search` takes."""
    section = result.get("gpu", {})
    plain = next((r for r in section.get(dtype, []) if r["step"] == "plain jit" and "ms" in r),
                 None)
    if plain is None:
        raise ConfigError(f"the GPU bench JSON has no measured plain jit in {dtype} (its "
                          f"dtypes: {[d for d in ('bfloat16', 'float32') if d in section]}); "
                          f"run `make gpu` on the GPU, or give --machine FLOPS,BYTES/S,SECONDS")
    return 1e12 * plain["model_tflops"], section["device_kind"]
