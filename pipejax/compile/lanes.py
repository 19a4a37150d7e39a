"""A schedule's lanes as the table interpreter compiles and reads them.

`lane_plan` says which ops the executor compiles, in which lane and order,
and whether a lane mixes ops (then each task's op is read from the table);
`lane_rows` turns the table into the scan's input, one row per tick.
"""

from __future__ import annotations

import jax.numpy as jnp

from pipejax.errors import ConfigError
from pipejax.schedules import Op, Schedule


def lane_plan(schedule: Schedule) -> list[tuple[int, Op, bool]]:
    """(lane, op, mixed) for every op the executor compiles, in the order it
    runs them; `mixed`: the lane holds other ops too, so the task's op is
    read from the table. Each op kind sits in one lane."""
    plan = [(lane, op, len(schedule.lane_ops(lane)) > 1)
            for lane in range(schedule.lanes) for op in schedule.lane_ops(lane)]
    ops = [op for _, op, _ in plan]
    twice = {op for op in ops if ops.count(op) > 1}
    if twice:
        raise ConfigError(f"schedule {schedule.name!r} runs {sorted(o.name for o in twice)} in "
                          "more than one lane; put each op kind in one lane")
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
