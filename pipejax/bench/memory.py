"""Compiled against predicted memory per device, and the padding of packed buffers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from pipejax.bench.machine import CLASSES, FEATURES, batch, on_devices
from pipejax.partition.padding import padding as split_padding
from pipejax.partition.padding import splits


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def memory() -> list[dict]:
    models = {"MLP 4x256": pj.models.mlp(depth=4, width=256, classes=CLASSES),
              "ResNet 6 blocks": pj.models.resnet(classes=CLASSES)}
    rows, mb, M, K = [], 32, 8, 4
    for name, layers in models.items():
        for schedule in ("gpipe", "1f1b", "pipedream", "pb"):
            synchronous = pj.schedules.make_schedule(schedule, pj.Placement(K), M).synchronous
            for remat in ("stage", "none"):
                stash = schedule == "pipedream"
                if remat == "none" and not (synchronous or stash):
                    continue  # PB's backward runs on newer weights: needs remat
                with on_devices(K) as mesh:
                    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                                       example=jnp.zeros((mb, FEATURES)), stages=K,
                                       microbatches=M, schedule=schedule, remat=remat,
                                       weight_stashing=stash, mesh=mesh)
                    trainer = pipe.trainer(optax.adam(1e-3))
                    state = trainer.init(pipe.init(jax.random.key(0)))
                    compiled = trainer.step.lower(state, batch(M * mb)).compile()
                predicted, peak = trainer.memory(), peak_bytes(compiled)
                rows.append({"model": name, "schedule": schedule, "remat": remat,
                             "compiled_bytes": peak, "predicted_bytes": predicted.total,
                             "error": f"{100 * (predicted.total / peak - 1):+.1f}%",
                             "heaviest_stage": predicted.heaviest})
    return rows


def padding() -> list[dict]:
    """Each model's default split (its padding, and its cost: the largest
    stage's estimated FLOPs over the mean), the least padding of any split,
    and the split `max_padding` picks at that least padding rounded up to a
    percent, where that is below the default's."""
    models = {"MLP 4x256": pj.models.mlp(depth=4, width=256, classes=CLASSES),
              "ResNet 6 blocks": pj.models.resnet(classes=CLASSES),
              "Transformer 4x64": pj.models.transformer(classes=CLASSES),
              "VGG": pj.models.vgg(classes=CLASSES, dims=1)}
    rows = []
    for name, layers in models.items():
        for K in (2, 4):
            with on_devices(K) as mesh:
                build = lambda **bound: pj.pipeline(
                    layers, loss=pj.losses.cross_entropy, example=jnp.zeros((8, FEATURES)),
                    stages=K, microbatches=4, mesh=mesh, **bound)
                pipe = build()
                least = min(split_padding(pipe.specs, s) for s in splits(len(pipe.specs), K))
                bound = math.ceil(100 * least) / 100
                bounded = build(max_padding=bound) if bound < pipe.layout.padding_overhead else None
            rows.append({"model": name, "K": K, "padded_param_bytes": pipe.layout.padded_param_bytes,
                         **_split("default", pipe),
                         "least_padding_any_split": f"{100 * least:.1f}%",
                         "max_padding": bound if bounded else None,
                         **_split("bounded", bounded), "branches": len(pipe.build.code.groups)})
    return rows


def _split(name: str, pipe: pj.Pipeline | None) -> dict:
    """A pipeline's split, its padding and its cost (largest stage over the mean)."""
    if pipe is None:
        return {f"{name}_split": None, f"{name}_padding": None, f"{name}_cost": None}
    costs = pipe.plan.costs
    return {f"{name}_split": list(pipe.plan.split),
            f"{name}_padding": f"{100 * pipe.layout.padding_overhead:.1f}%",
            f"{name}_cost": round(max(costs) * len(costs) / sum(costs), 2)}
