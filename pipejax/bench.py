"""`pipejax bench`: the measurements behind the README's claims, in one run.

Sections (each a table, all in one JSON with the machine and versions):
  overhead   1-stage pipelined step over a plain `jax.jit` of the same model
             and optimizer (micro-batched by a `lax.scan`, and whole-batch);
  bubbles    idle share of each schedule's table over n steps (and the
             flush) against the closed form;
  memory     compiled peak bytes of one device (`memory_analysis()`:
             argument + output + temp; SPMD buffers are padded to the largest
             stage, so this is the heaviest stage) per schedule and remat
             mode, against `trainer.memory()`'s prediction;
  compile    compile time of the training step against micro-batches,
             stages, and depth (shared branches against one per stage);
  padding    padded over real bytes of the packed parameter buffers;
  gpu        (on a GPU) a Transformer of 8 blocks, width 1024, at K = 1:
             step time, examples/s and model FLOP utilisation (model FLOPs:
             forward + backward of every layer; peak: the device's dense
             TF32 rate), pipelined and plain jit.
Stages beyond the default backend's devices run on simulated CPU devices.
Ratios are measured in one run (alternating calls), never across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj

FEATURES, CLASSES = 40, 10
# Dense peak FLOP/s of one device for the dtype the model computes in (float32
# matmuls run as TF32 on these GPUs under JAX's default precision).
PEAK_FLOPS = {"H100": 494.7e12, "H200": 494.7e12, "A100": 156e12}


def environment(argv: list[str]) -> dict:
    import flax

    return {"machine": platform.machine(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "pipejax": pj.__version__,
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "devices": len(jax.devices()), "command": " ".join(["pipejax bench", *argv]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths)),
             "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells])


@contextlib.contextmanager
def _devices(K: int) -> Iterator[jax.sharding.Mesh]:
    """A mesh of K devices of the default backend, or of simulated CPU
    devices if it has fewer (then tracing and costing run on the CPU too)."""
    if len(jax.devices()) >= K:
        yield pj.make_mesh(K, devices=jax.devices()[:K])
        return
    cpus = jax.devices("cpu")
    with jax.default_device(cpus[0]):
        yield pj.make_mesh(K, devices=cpus[:K])


def _batch(n: int, shape: tuple = (FEATURES,)) -> tuple:
    return (jax.random.normal(jax.random.key(1), (n, *shape)),
            jax.random.randint(jax.random.key(2), (n,), 0, CLASSES))


def _alternate(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, np.ndarray]:
    """Seconds of each run, called in turn `repeats` times (the machine's
    drifts hit every run alike); three warm-up rounds first."""
    for _ in range(3):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: np.asarray(t) for name, t in times.items()}


def step_times(layers: list, example: jax.Array, M: int, opt: optax.GradientTransformation,
               repeats: int, remat: str = "none") -> dict:
    """Seconds per step of the 1-stage pipelined step (`remat`) and of
    plain jits of the same model (micro-batched, whole batch), alternated;
    the model's FLOPs per step and XLA's bytes accessed by each program."""
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=example, stages=1,
                       microbatches=M, remat=remat)
    params = pipe.init(jax.random.key(0))
    trainer = pipe.trainer(opt)
    x, y = _batch(M * example.shape[0], example.shape[1:])
    variables = pj.unstage(params)

    def loss(v, x, y):
        return pj.losses.cross_entropy(pj.apply_layers(layers, v, x), y)

    def microbatched(v, x, y):
        def one(acc, xy):
            value, g = jax.value_and_grad(loss)(v, *xy)
            return jax.tree.map(jnp.add, acc, (value, g)), None
        split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
        (value, g), _ = jax.lax.scan(one, (jnp.zeros(()), jax.tree.map(jnp.zeros_like, v)),
                                     (split(x), split(y)))
        return value / M, jax.tree.map(lambda a: a / M, g)

    def make(grad_fn):
        @jax.jit
        def step(v, s, x, y):
            value, g = grad_fn(v, x, y)
            u, s = opt.update(g, s, v)
            return optax.apply_updates(v, u), s, value
        return step

    plain = {"plain_microbatched": make(microbatched), "plain_full_batch": make(
        jax.value_and_grad(loss))}
    held = {"pipelined": trainer.init(params),
            **{n: (variables, opt.init(variables)) for n in plain}}

    def runner(name):
        def run():
            if name == "pipelined":
                held[name], m = trainer.step(held[name], (x, y))
                jax.block_until_ready(m["loss"])
            else:
                v, s, value = plain[name](*held[name], x, y)
                held[name] = (v, s)
                jax.block_until_ready(value)
        return run

    t = _alternate({n: runner(n) for n in ["pipelined", *plain]}, repeats)
    analyses = {"pipelined": trainer.step.lower(held["pipelined"], (x, y)),
                **{n: plain[n].lower(*held[n], x, y) for n in plain}}
    analyses = {n: _cost(lowered.compile()) for n, lowered in analyses.items()}
    return {"seconds": {n: float(np.median(v)) for n, v in t.items()},
            "over_microbatched": float(np.median(t["pipelined"] / t["plain_microbatched"])),
            "over_full_batch": float(np.median(t["pipelined"] / t["plain_full_batch"])),
            "flops_per_step": M * _model_flops(layers, example),
            "bytes_accessed": {n: int(a.get("bytes accessed", 0)) for n, a in analyses.items()},
            "examples": int(x.shape[0]), "rounds": repeats}


def _model_flops(layers: list, example: jax.Array) -> float:
    """Forward + backward FLOPs of one micro-batch, summed over the layers as
    `pj.trace` counts them with XLA's CPU cost analysis (on a GPU, matrix
    products are library calls the analysis does not count)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return float(sum(spec.flops or 0.0 for spec in pj.trace(layers, example)))


def _cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program (one dict)."""
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, (list, tuple)) else analysis) or {}


def overhead(repeats: int) -> list[dict]:
    out = step_times(pj.models.mlp(depth=8, width=512, classes=CLASSES),
                     jnp.zeros((64, FEATURES)), 4, optax.sgd(0.01, momentum=0.9), repeats)
    s = out["seconds"]
    return [{"model": "MLP 8x512, B=256, M=4", "pipelined_ms": round(1e3 * s["pipelined"], 2),
             "plain_microbatched_ms": round(1e3 * s["plain_microbatched"], 2),
             "plain_full_batch_ms": round(1e3 * s["plain_full_batch"], 2),
             "over_microbatched": round(out["over_microbatched"], 3),
             "over_full_batch": round(out["over_full_batch"], 3)}]


def _bubble_formula(name: str, K: int, M: int, steps: int) -> tuple[float, str]:
    """Idle share over `steps` steps (and the flush of an asynchronous one):
    a synchronous step fills and drains every step (GPipe §2); PipeDream fills
    once; PB's backward lane also waits K − 1 ticks for its first gradient."""
    if name in ("gpipe", "1f1b"):
        return (K - 1) / (M + K - 1), "(K-1)/(M+K-1)"
    if name == "pb":
        return 2 * (K - 1) / (steps * M + 2 * (K - 1)), "2(K-1)/(nM+2(K-1))"
    return (K - 1) / (steps * M + K - 1), "(K-1)/(nM+K-1)"


def bubbles() -> list[dict]:
    rows = []
    for name in ("gpipe", "1f1b", "pipedream", "pb"):
        for K, M in ((4, 8), (8, 32)):
            s = pj.schedules.make_schedule(name, K, M)
            one, formula = _bubble_formula(name, K, M, 1)
            many, _ = _bubble_formula(name, K, M, 32)
            rows.append({"schedule": name, "K": K, "M": M, "ticks": s.ticks,
                         "table_n=1": round(s.bubble_fraction, 4), "formula_n=1": round(one, 4),
                         "table_n=32": round(s.bubble_fraction_over(32), 4),
                         "formula_n=32": round(many, 4), "formula": formula})
    return rows


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def memory() -> list[dict]:
    models = {"MLP 4x256": pj.models.mlp(depth=4, width=256, classes=CLASSES),
              "ResNet 6 blocks": pj.models.resnet(classes=CLASSES)}
    rows, mb, M, K = [], 32, 8, 4
    for name, layers in models.items():
        for schedule in ("gpipe", "1f1b", "pipedream", "pb"):
            synchronous = pj.schedules.make_schedule(schedule, K, M).synchronous
            for remat in ("stage", "none"):
                stash = schedule == "pipedream"
                if remat == "none" and not (synchronous or stash):
                    continue  # PB's backward runs on newer weights: needs remat
                with _devices(K) as mesh:
                    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                                       example=jnp.zeros((mb, FEATURES)), stages=K,
                                       microbatches=M, schedule=schedule, remat=remat,
                                       weight_stashing=stash, mesh=mesh)
                    trainer = pipe.trainer(optax.adam(1e-3))
                    state = trainer.init(pipe.init(jax.random.key(0)))
                    compiled = trainer.step.lower(state, _batch(M * mb)).compile()
                predicted, peak = trainer.memory(), _peak(compiled)
                rows.append({"model": name, "schedule": schedule, "remat": remat,
                             "compiled_bytes": peak, "predicted_bytes": predicted.total,
                             "error": f"{100 * (predicted.total / peak - 1):+.1f}%",
                             "heaviest_stage": predicted.heaviest})
    return rows


def _compile_seconds(layers: list, K: int, M: int, mb: int = 4) -> dict:
    with _devices(K) as mesh:
        start = time.perf_counter()
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                           example=jnp.zeros((mb, FEATURES)), stages=K, microbatches=M, mesh=mesh)
        traced = time.perf_counter()
        trainer = pipe.trainer(optax.sgd(0.01))
        state = trainer.init(pipe.init(jax.random.key(0)))
        ready = time.perf_counter()
        trainer.step.lower(state, _batch(M * mb)).compile()
        done = time.perf_counter()
    return {"layers": len(layers), "K": K, "M": M, "branches": len(pipe.code.groups),
            "trace_s": round(traced - start, 2), "init_s": round(ready - traced, 2),
            "step_compile_s": round(done - ready, 2)}


def _deep(n: int) -> list:
    import flax.linen as nn

    return [layer for _ in range(n) for layer in (nn.Dense(64), nn.relu)] + [nn.Dense(CLASSES)]


def compile_times() -> dict:
    from pipejax.compile import sharing

    mlp = pj.models.mlp(depth=8, width=256, classes=CLASSES)
    _compile_seconds(mlp, 4, 4)  # JAX's own start-up costs, before timing
    by_m = [_compile_seconds(mlp, 4, M) for M in (4, 16, 64)]
    by_k = [_compile_seconds(mlp, K, 8) for K in (1, 2, 4, 8)]
    by_depth, most = [], len(jax.devices("cpu"))
    for n, K in ((4, 4), (32, min(32, most)), (128, min(32, most))):
        shared = _compile_seconds(_deep(n), K, 8)
        by = sharing.StageGroups.by
        sharing.StageGroups.by = classmethod(lambda cls, keys, same: cls.none(len(keys)))
        try:  # the program before shared branches: one branch per stage
            own = _compile_seconds(_deep(n), K, 8)
        finally:
            sharing.StageGroups.by = by
        by_depth.append({**shared, "per_stage_branches": own["branches"],
                         "per_stage_step_compile_s": own["step_compile_s"],
                         "per_stage_init_s": own["init_s"],
                         "ratio": round(shared["step_compile_s"] / own["step_compile_s"], 3)})
    return {"by_microbatches": by_m, "by_stages": by_k, "by_depth": by_depth}


def padding() -> list[dict]:
    models = {"MLP 4x256": (pj.models.mlp(depth=4, width=256, classes=CLASSES), (FEATURES,)),
              "ResNet 6 blocks": (pj.models.resnet(classes=CLASSES), (FEATURES,)),
              "Transformer 4x64": (pj.models.transformer(classes=CLASSES), (FEATURES,)),
              "VGG": (pj.models.vgg(classes=CLASSES, dims=1), (FEATURES,))}
    rows = []
    for name, (layers, shape) in models.items():
        for K in (2, 4):
            with _devices(K) as mesh:
                pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                                   example=jnp.zeros((8, *shape)), stages=K, microbatches=4,
                                   mesh=mesh)
            lay = pipe.layout
            rows.append({"model": name, "K": K, "padded_param_bytes": lay.padded_param_bytes,
                         "padding": f"{100 * lay.padding_overhead:.1f}%",
                         "branches": len(pipe.code.groups)})
    return rows


def gpu(repeats: int) -> list[dict]:
    """A Transformer of 8 blocks, width 1024 at K = 1 against plain jit, with
    the residuals kept (remat none: the same work as plain jit) and recomputed."""
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
    layers = pj.models.transformer(layers=8, dim=1024, heads=16, classes=CLASSES, patch=4)
    example = jnp.zeros((32, 256))  # 32 signals of 256 samples: 64 tokens each
    rows = []
    for remat in ("none", "stage"):
        out = step_times(layers, example, 4, optax.adam(1e-4), repeats, remat)
        for name, seconds in out["seconds"].items():
            if remat == "stage" and name != "pipelined":
                continue  # the plain steps again, for the ratio of this round
            achieved = out["flops_per_step"] / seconds
            rows.append({"step": name + (f" remat={remat}" if name == "pipelined" else ""),
                         "ms": round(1e3 * seconds, 2),
                         "examples_per_s": round(out["examples"] / seconds, 1),
                         "model_tflops": round(achieved / 1e12, 1),
                         "mfu": None if peak is None else round(achieved / peak, 4),
                         "over_plain_microbatched": round(
                             out["over_microbatched"] if name == "pipelined"
                             else seconds / out["seconds"]["plain_microbatched"], 3),
                         "gb_accessed": round(out["bytes_accessed"][name] / 1e9, 1)})
    return rows


def plot(results: dict, path: Path) -> None:
    """One PNG: compiled against predicted memory, compile time against
    depth (shared and per-stage branches), and the bubble against M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("memory", "compile", "bubbles") if p in results]
    if not panels:
        return
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
        else:
            for name in ("gpipe", "pipedream", "pb"):
                K = 4
                Ms = np.arange(1, 65)
                ax.plot(Ms, [_bubble_formula(name, K, int(M), 1)[0] for M in Ms], label=name)
                ax.plot([r["M"] for r in results["bubbles"] if r["schedule"] == name
                         and r["K"] == K], [r["table_n=1"] for r in results["bubbles"]
                                            if r["schedule"] == name and r["K"] == K], "ko")
            ax.set(xlabel="micro-batches M (K = 4, one step)", ylabel="bubble",
                   title="bubble: closed form (lines), table (dots)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipejax bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/bench_<backend>.json "
                             "when run from the repository, else ./bench_<backend>.json)")
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds per comparison")
    parser.add_argument("--only", nargs="*", default=None,
                        choices=["overhead", "bubbles", "memory", "compile", "padding", "gpu"])
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    sections = {"overhead": lambda: overhead(args.repeats), "bubbles": bubbles,
                "memory": memory, "compile": compile_times, "padding": padding}
    if jax.default_backend() == "gpu":
        sections["gpu"] = lambda: gpu(args.repeats)
    chosen = args.only or list(sections)
    results, start = {}, time.perf_counter()
    for name in chosen:
        began = time.perf_counter()
        results[name] = sections[name]()
        print(f"\n== {name} ({time.perf_counter() - began:.0f} s)")
        parts = results[name] if isinstance(results[name], dict) else {name: results[name]}
        for part, rows in parts.items():
            if len(parts) > 1:
                print(f"-- {part}")
            print(table(rows))
    results["seconds"] = round(time.perf_counter() - start, 1)
    repo = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    out = args.out or (repo if repo.is_dir() else Path(".")) / f"bench_{jax.default_backend()}.json"
    out.write_text(json.dumps({"environment": environment(argv), **results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"\n{results['seconds']:.0f} s in all; wrote {out} and {out.with_suffix('.png').name}")
    return 0
