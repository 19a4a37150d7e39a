"""The checks of `pj.pipeline`'s settings: each one in range, or a clear
`ConfigError` naming the setting and what to give instead (`LayerError` for
an empty layer list)."""

from __future__ import annotations

from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.errors import ConfigError, LayerError
from pipejax.placement import Placement
from pipejax.schedules import FAMILIES, Schedule

REMATS = ("none", "stage")
# What a stage keeps for its backward: "stage" (its input: the forward runs
# again), "none" (what its costly primitives made) or a `jax.checkpoint` policy.
Remat = Literal["none", "stage"] | Callable[..., bool]


def remat(remat: Any) -> Remat:
    """`remat` if it is 'none', 'stage' or a `jax.checkpoint` policy."""
    if isinstance(remat, str):
        if remat not in REMATS:
            raise ConfigError(f"unknown remat {remat!r}; use 'none', 'stage' or a "
                              "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable")
    elif not callable(remat):
        raise ConfigError(f"remat must be 'none', 'stage' or a jax.checkpoint policy, not {remat!r}")
    return remat


def padding(max_padding: Any) -> float | None:
    """`max_padding` if it is a fraction >= 0 or None."""
    if max_padding is not None and not (isinstance(max_padding, (int, float))
                                        and max_padding >= 0):
        raise ConfigError(f"max_padding={max_padding!r}; use a fraction >= 0 (0.25: padded "
                          "buffers at most 25% larger than the parameters) or None")
    return max_padding


def dtype(dtype: Any) -> Any:
    """`compute_dtype` as a floating-point dtype, or None."""
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


def counts(layers: tuple, placement: Placement, microbatches: Any) -> None:
    """Raise unless every (virtual) stage of `placement` gets a layer and M >= 1."""
    if len(layers) == 0:
        raise LayerError("the layer list is empty; give at least one layer")
    stages, virtual = placement.stages, placement.virtual
    if stages * virtual > len(layers):
        need = f"stages × virtual = {stages * virtual}" if virtual > 1 else f"stages={stages}"
        raise ConfigError(f"{need} > {len(layers)} layers; every (virtual) stage needs a "
                          "layer, use fewer stages or chunks or split the model into more layers")
    if not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r}; use at least 1")


def staleness(schedule: Schedule, remat: Any, weight_stashing: bool) -> None:
    """Raise where weight stashing or remat does not fit the schedule's staleness."""
    if weight_stashing and schedule.synchronous:
        raise ConfigError(f"weight_stashing=True needs an asynchronous schedule; under "
                          f"{schedule.name!r} every backward already uses its forward's weights")
    if weight_stashing and schedule.double_buffered:
        raise ConfigError(f"weight_stashing=True: {schedule.name!r} runs a micro-batch's "
                          "forward and backward on its step's weight version already; "
                          "drop weight_stashing")
    if not schedule.consistent and not weight_stashing and remat != "stage":
        raise ConfigError(
            f"remat={remat!r} keeps residuals computed with the forward's weights, but the "
            f"backward of {schedule.name!r} uses the current weights (the exact vjp at "
            "(backward weights, stashed input)); use remat='stage' or weight_stashing=True")


def forecast(schedule: Schedule, forecasting: list[bool]) -> None:
    """Raise where a stage's optimizer ends in `weight_forecast`
    (`forecasting`, per stage) but the schedule's table has nothing for it
    to forecast: synchronous (every backward meets its forward's weights),
    or double-buffered (PipeDream-2BW: every op of a step runs on one
    version, one update behind, and no update comes between a forward and
    its backward; the delay's correction there acts on the update)."""
    if not any(forecasting) or not (schedule.synchronous or schedule.double_buffered):
        return
    head = (f"stage {forecasting.index(True)}'s optimizer ends in weight_forecast, but "
            f"schedule {schedule.name!r}")
    if schedule.double_buffered:
        raise ConfigError(f"{head} runs every op of a step on one weight version, one update "
                          "behind (double-buffered): no update comes between a forward and its "
                          "backward to forecast; drop the forecast (the one-step delay's "
                          "correction is pj.transforms.error_feedback, recipe 'ef')")
    asynchronous = ", ".join(sorted(repr(n) for n, f in FAMILIES.items() if f.asynchronous))
    raise ConfigError(f"{head} is synchronous: every backward sees the weights its forward "
                      f"used, so there is nothing to forecast; use an asynchronous schedule "
                      f"({asynchronous}) or drop the forecast")


def ties(ties: tuple, specs: tuple, schedule: Schedule) -> None:
    """Raise unless the pipeline keeps tied copies equal: a synchronous
    table (each copy's gradient is summed over the stages, whole, split
    over `tensor` or in fsdp pieces, compile/ties.py)."""
    if not ties:
        return
    i, j = ties[0].holders[0][0], ties[0].holders[1][0]
    held = f"layers {i} ({specs[i].name}) and {j} ({specs[j].name}) share a module (tied weights)"
    if schedule.asynchronous:
        raise ConfigError(
            f"{held}, but {schedule.name!r} updates each stage with its own delayed gradient, "
            "so the copies would part; use a synchronous schedule ('1f1b', 'gpipe', "
            "'interleaved', ...), or give each layer its own module")


def sharded(F: int, example: Any, targets: Any) -> tuple:
    """(example, targets): one device's part of a micro-batch split over a
    stage's F devices, after checking that it splits."""
    if F == 1:
        return example, targets
    for name, tree in (("example", example), ("targets", targets)):
        for leaf in jax.tree.leaves(tree):
            if not leaf.shape or leaf.shape[0] % F:
                raise ConfigError(
                    f"{name} {leaf.dtype}{list(leaf.shape)}: a micro-batch of "
                    f"{leaf.shape[0] if leaf.shape else 0} examples does not split over the "
                    f"mesh's fsdp={F} devices of a stage; use a micro-batch size divisible by {F}")
    part = lambda leaf: jax.ShapeDtypeStruct((leaf.shape[0] // F, *leaf.shape[1:]), leaf.dtype)
    return jax.tree.map(part, example), jax.tree.map(part, targets)
