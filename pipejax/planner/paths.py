"""A step's time from its table and each op's cost, as its devices run it.

`executed` sums every task of the table; `critical_path` sums, per tick,
the most any device runs (simulated devices in one process run their ticks
in lock step: a collective is a rendezvous of every device it names);
`earliest_path` runs each op as early as its input allows; `coupled_path`
as the executor's collectives hold a device that receives until its
senders end their tick, as devices of their own run; `busy_ticks` counts
the ticks a device runs some of the given ops at (a sharded stage gathers
its weights at each tick with an op, scatters a gradient at each with a
weight gradient). The costs are the planner's (`costs.py`) or measured
(`pipejax bench`).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from pipejax.compile import carried, collectives
from pipejax.schedules import Op, Schedule
from pipejax.schedules.tasks import BACKWARD


def _task_costs(schedule: Schedule, costs: dict[Op, list[float]]):
    """`[ticks][stages]`: what each device runs at each tick, in the ops'
    `costs` (FLOPs, bytes)."""
    chunk = schedule.placement.chunk
    return [[sum(costs[Op(op)][chunk(k, c)] for op, _, c in schedule.table[t, k] if op != Op.IDLE)
             for k in range(schedule.stages)] for t in range(schedule.ticks)]


def executed(schedule: Schedule, costs: dict[Op, list[float]]) -> float:
    """What a step executes: every task of the table at its op's cost."""
    return float(sum(sum(row) for row in _task_costs(schedule, costs)))


def critical_path(schedule: Schedule, costs: dict[Op, list[float]]) -> float:
    """The cost along the lock-step ticks: per tick the most one device runs."""
    return float(sum(max(row) for row in _task_costs(schedule, costs)))


def _timed(schedule: Schedule, costs: dict[Op, Sequence[float]], pair: float | None,
           updates: Sequence[float] | None) -> tuple[Iterator[tuple], np.ndarray]:
    """Each tick's ops in the table's order, as (tick, device, op, virtual
    stage, micro-batch, what it takes): a fused last-stage pair at `pair`
    (its forward free), an asynchronous table's backward with its share of
    the device's update after it (a double-buffered one's at a step's last
    micro-batch); and the updates a synchronous table runs
    after its last tick (zeros for an asynchronous one)."""
    last, chunk = len(costs[Op.F]) - 1, schedule.placement.chunk
    device = [schedule.placement.device(j) for j in range(last + 1)]
    updates = np.zeros(schedule.stages) if updates is None else np.asarray(updates, float)
    after_backward = updates / np.bincount(device, minlength=schedule.stages).clip(1)
    M = schedule.microbatches  # a double-buffered table updates at a step's last backward
    updates_at = lambda g: not schedule.double_buffered or g % M == M - 1

    def ops():
        for t in range(schedule.ticks):
            for k in range(schedule.stages):
                for op, g, c in schedule.table[t, k]:
                    if op == Op.IDLE:
                        continue
                    op, j = Op(op), chunk(k, c)
                    took = costs[op][j]
                    if pair is not None and schedule.fused[t, k] and j == last:
                        took = 0.0 if op == Op.F else pair
                    if schedule.asynchronous and op in (Op.BW, Op.W) and updates_at(g):
                        took += after_backward[k]
                    yield t, k, op, j, g, took
    return ops(), np.zeros_like(updates) if schedule.asynchronous else updates


def earliest_path(schedule: Schedule, costs: dict[Op, Sequence[float]], pair: float | None = None,
                  updates: Sequence[float] | None = None, lockstep: bool = False) -> float:
    """The step of devices of their own: each op of the table as early as
    its device's order and its input allow (a forward after the previous
    virtual stage's forward of its micro-batch, a backward after the next
    one's backward, where that op runs earlier in the same step; an
    asynchronous table's older ones ran a step before), no message or tick
    costing anything. `pair`: what the last stage's forward and backward
    cost as one vjp in a tick that fuses them (default: the two ops'
    costs). `updates`: each device's optimizer update, after its last op
    (an asynchronous table's after each backward: it updates there,
    compile/asynchronous.py). With `lockstep` every tick starts when the
    slowest device ended the last, as `critical_path` counts it.

    On 2 pinned cores (`python benchmarks/cores.py`, the zoo GPT at M = 8)
    the steps followed this, not the lock step: 1F1B remat "none" took
    456 ms at its fastest, its ops' own times laid out here 448 and in
    lock step 596."""
    ops, after = _timed(schedule, costs, pair, updates)
    free = np.zeros(schedule.stages)  # when each device's last op ends
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B", j, micro-batch) -> end
    tick = -1
    for t, k, op, j, g, took in ops:
        if lockstep and t != tick:
            free[:], tick = free.max(), t
        before = (done.get(("F", j - 1, g), 0.0) if op == Op.F
                  else done.get(("B", j + 1, g), 0.0) if op in BACKWARD else 0.0)
        free[k] = max(free[k], before) + took
        if op != Op.W:
            done["F" if op == Op.F else "B", j, g] = free[k]
    return float(max(free + after))


def coupled_path(schedule: Schedule, costs: dict[Op, Sequence[float]], pair: float | None = None,
                 updates: Sequence[float] | None = None) -> float:
    """The step as the executor couples its devices: each device runs its
    ops back to back, and a tick's messages are collectives
    (compile/messages.py), each run at the ticks where the table sends
    along its pairs (`carried`), every pair at once. A device that receives
    along a collective starts its next tick when its senders have ended
    theirs, whether or not what they send is needed yet (no link time); a
    sender waits for no one. `pair` and `updates` as `earliest_path`'s.

    Neither bound above is the executor: 1F1B's collectives each go one
    way, so its devices follow their inputs, as `earliest_path` lays them;
    interleaved at K = 2 sends both ways round a ring of two at every tick,
    so each tick waits for the slower device's op, as in lock step. On 2
    pinned cores (`python benchmarks/cores.py`, `coupled_ms`) this ranked
    the zoo GPT's tables by their fastest steps with Spearman 0.61 and
    0.63 at M = 8 and 4, the lock step 0.36 and 0.50, `earliest_path`
    0.04 and 0.35; the MLP's rows, which differ by less than the
    machine's noise, 0.37, 0.42 and 0.22."""
    ops, after = _timed(schedule, costs, pair, updates)
    busy, routes = carried(schedule), collectives(schedule.placement)
    free, tick = np.zeros(schedule.stages), 0

    def exchange(t: int) -> None:
        ended = free.copy()
        for c, pairs in enumerate(routes):
            if busy[t, c]:
                for source, destination in pairs:
                    free[destination] = max(free[destination], ended[source])
    for t, k, _, _, _, took in ops:
        for passed in range(tick, t):
            exchange(passed)
        tick = t
        free[k] += took
    for passed in range(tick, schedule.ticks):
        exchange(passed)
    return float(max(free + after))


def busy_ticks(schedule: Schedule, ops: tuple[Op, ...]) -> int:
    """The most ticks any device runs one of `ops` at."""
    return int(np.isin(schedule.ops, ops).any(axis=2).sum(axis=0).max())
