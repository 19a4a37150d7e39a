"""What a pass over the table reports: which ticks finish a micro-batch's
loss, and the metrics of a step (losses, counts, consensus, skipped updates)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.schedules import NONE, Op, Schedule
from pipejax.schedules.tasks import BACKWARD


def loss_ticks(schedule: Schedule, deferred: bool = False) -> np.ndarray:
    """The ticks on which the last virtual stage computes a micro-batch's
    loss, ordered by that micro-batch's id: its forwards' ticks, or its
    backwards' where they run the forward (`deferred`, last_stage.py)."""
    lane = last_stage_cells(schedule, BACKWARD if deferred else (Op.F,))
    ticks = np.flatnonzero(lane != NONE)
    return ticks[np.argsort(lane[ticks], kind="stable")]


def finishing(schedule: Schedule) -> np.ndarray:
    """Relative ids of the M micro-batches whose loss one pass computes, in order."""
    return last_stage_cells(schedule, (Op.F,))[loss_ticks(schedule)]


def last_stage_cells(schedule: Schedule, ops: tuple[Op, ...]) -> np.ndarray:
    """`[ticks]`: the micro-batch the last virtual stage runs one of `ops`
    on, or NONE."""
    placement = schedule.placement
    last = placement.chunks - 1
    k, c = placement.device(last), placement.local(last)
    return np.where(schedule.cells(ops, field=2)[:, k] == c, schedule.cells(ops)[:, k], NONE)


def metrics(losses: jax.Array, done: jax.Array, ids: jax.Array,
            spread: jax.Array | None = None, skipped: jax.Array | None = None) -> dict:
    """The metrics of a step: mean loss of the finished micro-batches (NaN if
    none), their count, and each micro-batch's loss (NaN if not finished);
    under a decentralized data rule, the replicas' consensus distance; with
    the non-finite guard, the updates it skipped."""
    count = jnp.sum(done.astype(jnp.int32))
    total = jnp.sum(jnp.where(done, losses, 0.0))
    out = {"loss": jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan),
           "completed": count, "losses": jnp.where(done, losses, jnp.nan),
           "microbatch": ids.astype(jnp.int32)}
    if spread is not None:
        out["consensus_distance"] = spread
    if skipped is not None:
        out["skipped"] = skipped
    return out
