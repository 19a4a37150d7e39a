"""A schedule's lanes as the table interpreter compiles and reads them.

`compiled_lanes` says which ops the executor compiles, in which lane and order,
and whether a lane mixes ops (then each task's op is read from the table);
`lane_rows` turns the table into the scan's input, one row per tick, and
`read_task` reads a device's task out of one row as a `TickTask` of traced
values (the table's own `Task` is static data: schedules/tasks.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules import NONE, Op, Schedule


class TickTask(NamedTuple):
    """A task of one device at one tick, traced: its micro-batch id g,
    whether it runs, its virtual stage j (local chunk c of device k) and
    its ring id g·v + c."""

    g: jax.Array
    real: jax.Array
    j: jax.Array
    ring: jax.Array


class Counters(NamedTuple):
    """Which micro-batch ids a pass runs: id = base + the table's relative
    id, real for start <= id < fed."""

    base: jax.Array
    start: jax.Array
    fed: jax.Array


class LaneRow(NamedTuple):
    """One lane of the table as the scan reads it, each `[ticks, stages]`
    int32: the micro-batches, the op codes (None unless the lane mixes ops)
    and the local chunks (None without virtual stages)."""

    microbatch: jax.Array
    op: jax.Array | None
    chunk: jax.Array | None


class Lane(NamedTuple):
    """An op the executor compiles in lane `index`; `mixed`: the lane holds
    other ops too, so each task's op is read from the table."""

    index: int
    op: Op
    mixed: bool


def compiled_lanes(schedule: Schedule) -> list[Lane]:
    """A `Lane` for every op the executor compiles, in the order it runs
    them. Each op kind sits in one lane."""
    lanes = [Lane(lane, op, len(schedule.lane_ops(lane)) > 1)
            for lane in range(schedule.lanes) for op in schedule.lane_ops(lane)]
    ops = [lane.op for lane in lanes]
    twice = {op for op in ops if ops.count(op) > 1}
    if twice:
        raise ConfigError(f"schedule {schedule.name!r} runs {sorted(o.name for o in twice)} in "
                          "more than one lane; put each op kind in one lane")
    return lanes


def lane_rows(schedule: Schedule, compiled: list[Lane]) -> tuple[LaneRow, ...]:
    """The scan's input: a `LaneRow` per lane of the table; the op codes only
    when the lane mixes ops (`compiled`), the chunks only with virtual stages."""
    mixed = {lane.index: lane.mixed for lane in compiled}
    rows = []
    for lane in range(schedule.lanes):
        col = lambda field: jnp.asarray(schedule.table[:, :, lane, field], jnp.int32)
        rows.append(LaneRow(col(1), col(0) if mixed.get(lane) else None,
                            col(2) if schedule.placement.virtual > 1 else None))
    return tuple(rows)


def read_task(cell: LaneRow, op: Op, k: jax.Array, placement: Placement,
              counters: Counters) -> TickTask:
    """Device k's task of lane `cell` at this tick. It is real if the table
    names `op` there and its micro-batch was fed (`counters`)."""
    base, start, fed = counters
    rel, ops, chunks = cell.microbatch[k], cell.op, cell.chunk
    g = base + rel
    real = (rel != NONE) & (g >= start) & (g < fed)
    if ops is not None:
        real = real & (ops[k] == int(op))
    c = chunks[k] if chunks is not None else jnp.int32(0)
    return TickTask(g, real, placement.chunk(k, c), placement.ring(g, c))
