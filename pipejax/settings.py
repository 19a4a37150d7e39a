"""The checks of `pj.pipeline`'s settings: each one in range, or a clear
`ConfigError` naming the setting and what to give instead (`LayerError` for
an empty layer list)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pipejax.errors import ConfigError, LayerError
from pipejax.schedules import Schedule

REMATS = ("none", "stage")


def check_remat(remat: Any) -> Any:
    if isinstance(remat, str):
        if remat not in REMATS:
            raise ConfigError(f"unknown remat {remat!r}; use 'none', 'stage' or a "
                              "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable")
    elif not callable(remat):
        raise ConfigError(f"remat must be 'none', 'stage' or a jax.checkpoint policy, not {remat!r}")
    return remat


def check_padding(max_padding: Any) -> float | None:
    if max_padding is not None and not (isinstance(max_padding, (int, float))
                                        and max_padding >= 0):
        raise ConfigError(f"max_padding={max_padding!r}; use a fraction >= 0 (0.25: padded "
                          "buffers at most 25% larger than the parameters) or None")
    return max_padding


def check_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ConfigError(f"compute_dtype={dtype!r} is not a dtype; use jnp.bfloat16, "
                          "jnp.float16 or None") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ConfigError(f"compute_dtype={dtype} is not a floating-point dtype; use "
                          "jnp.bfloat16, jnp.float16 or None")
    return dtype


def check_counts(layers: tuple, stages: Any, microbatches: Any, virtual: Any = 1) -> None:
    if len(layers) == 0:
        raise LayerError("the layer list is empty; give at least one layer")
    if not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ConfigError(f"stages={stages!r}; a pipeline needs at least 1 stage")
    if not isinstance(virtual, (int, np.integer)) or virtual < 1:
        raise ConfigError(f"virtual={virtual!r}; give the model chunks per device, 1 or more")
    if stages * virtual > len(layers):
        chunks = f"stages × virtual = {stages * virtual}" if virtual > 1 else f"stages={stages}"
        raise ConfigError(f"{chunks} > {len(layers)} layers; every (virtual) stage needs a "
                          "layer, use fewer stages or chunks or split the model into more layers")
    if not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r}; use at least 1")


def check_staleness(schedule: Schedule, remat: Any, weight_stashing: bool) -> None:
    if weight_stashing and schedule.synchronous:
        raise ConfigError(f"weight_stashing=True needs an asynchronous schedule; under "
                          f"{schedule.name!r} every backward already uses its forward's weights")
    if schedule.asynchronous and not weight_stashing and remat != "stage":
        raise ConfigError(
            f"remat={remat!r} keeps residuals computed with the forward's weights, but the "
            f"backward of {schedule.name!r} uses the current weights (the exact vjp at "
            "(backward weights, stashed input)); use remat='stage' or weight_stashing=True")
