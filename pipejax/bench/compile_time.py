"""Compile time against micro-batches, stages and depth (shared against per-stage branches)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from pipejax.bench.machine import CLASSES, FEATURES, batch, on_devices


def _compile_seconds(layers: list, K: int, M: int, mb: int = 4, share: bool = True) -> dict:
    with on_devices(K) as mesh:
        start = time.perf_counter()
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                           example=jnp.zeros((mb, FEATURES)), stages=K, microbatches=M, mesh=mesh,
                           share_branches=share)
        traced = time.perf_counter()
        params = jax.block_until_ready(pipe.init(jax.random.key(0)))
        initialized = time.perf_counter()
        trainer = pipe.trainer(optax.sgd(0.01))
        state = trainer.init(params)
        ready = time.perf_counter()
        trainer.step.lower(state, batch(M * mb)).compile()
        done = time.perf_counter()
    return {"layers": len(layers), "K": K, "M": M, "branches": len(pipe.build.code.groups),
            "trace_s": round(traced - start, 2), "init_s": round(initialized - traced, 2),
            "step_compile_s": round(done - ready, 2)}


def _deep(n: int) -> list:
    import flax.linen as nn

    return [layer for _ in range(n) for layer in (nn.Dense(64), nn.relu)] + [nn.Dense(CLASSES)]


def compile_times() -> dict:
    mlp = pj.models.mlp(depth=8, width=256, classes=CLASSES)
    _compile_seconds(mlp, 4, 4)  # JAX's own start-up costs, before timing
    by_m = [_compile_seconds(mlp, 4, M) for M in (4, 16, 64)]
    by_k = [_compile_seconds(mlp, K, 8) for K in (1, 2, 4, 8)]
    by_depth, most = [], len(jax.devices("cpu"))
    for n, K in ((4, 4), (32, min(32, most)), (128, min(32, most))):
        shared = _compile_seconds(_deep(n), K, 8)
        own = _compile_seconds(_deep(n), K, 8, share=False)
        by_depth.append({**shared, "per_stage_branches": own["branches"],
                         "per_stage_step_compile_s": own["step_compile_s"],
                         "ratio": round(shared["step_compile_s"] / own["step_compile_s"], 3)})
    return {"by_microbatches": by_m, "by_stages": by_k, "by_depth": by_depth}
