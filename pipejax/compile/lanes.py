"""A schedule's lanes as the table interpreter compiles and reads them.

`lane_plan` says which ops the executor compiles, in which lane and order,
and whether a lane mixes ops (then each task's op is read from the table);
`lane_rows` turns the table into the scan's input, one row per tick, and
`read_task` reads a device's task out of one row.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pipejax.errors import ConfigError
from pipejax.schedules import NONE, Op, Schedule


class Task(NamedTuple):
    """A task of one device at one tick: its micro-batch id, whether it
    runs, its virtual stage j = c·K + k and its ring id g·v + c."""

    g: jax.Array
    real: jax.Array
    j: jax.Array
    ring: jax.Array


def lane_plan(schedule: Schedule) -> list[tuple[int, Op, bool]]:
    """(lane, op, mixed) for every op the executor compiles, in the order it
    runs them; `mixed`: the lane holds other ops too, so the task's op is
    read from the table. Each op kind sits in one lane; a table's backwards
    are all fused (BW) or all split (B, W)."""
    plan = [(lane, op, len(schedule.lane_ops(lane)) > 1)
            for lane in range(schedule.lanes) for op in schedule.lane_ops(lane)]
    ops = [op for _, op, _ in plan]
    twice = {op for op in ops if ops.count(op) > 1}
    if twice:
        raise ConfigError(f"schedule {schedule.name!r} runs {sorted(o.name for o in twice)} in "
                          "more than one lane; put each op kind in one lane")
    if Op.BW in ops and Op.B in ops:
        raise ConfigError(f"schedule {schedule.name!r} runs fused backwards (BW) and split ones "
                          "(B, W); the executor sends one kind of gradient message: split every "
                          "backward or none")
    return plan


def lane_rows(schedule: Schedule, plan: list) -> tuple:
    """The scan's input per tick: for each lane (micro-batches, op codes,
    chunks), each `[ticks, stages]` int32; the op codes only when the lane
    mixes ops (`plan`), the chunks only with virtual stages (else None)."""
    mixed = {lane: m for lane, _, m in plan}
    rows = []
    for lane in range(schedule.lanes):
        col = lambda field: jnp.asarray(schedule.table[:, :, lane, field], jnp.int32)
        rows.append((col(1), col(0) if mixed.get(lane) else None,
                     col(2) if schedule.virtual > 1 else None))
    return tuple(rows)


def read_task(cell: Any, op: Op, k: jax.Array, K: int, v: int, counters: tuple) -> Task:
    """Device k's task of lane `cell` (a `lane_rows` row). It is real if the
    table names `op` there and its micro-batch was fed: the id is base +
    relative id, real for start <= id < fed (`counters`)."""
    base, start, fed = counters
    rel, ops, chunks = cell
    rel = rel[k]
    g = base + rel
    real = (rel != NONE) & (g >= start) & (g < fed)
    if ops is not None:
        real = real & (ops[k] == int(op))
    c = chunks[k] if chunks is not None else jnp.int32(0)
    return Task(g, real, c * K + k, g * v + c)
