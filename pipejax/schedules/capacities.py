"""Ring-buffer capacities of a schedule, read off its unrolled table.

`ring_capacities(schedule)` gives the slots of every ring of the steady
state (`Schedule.steady`), what the executor allocates, once per schedule;
`in_flight(schedule, k)` the micro-batch chunks device k stashes at once.

Every value a device holds between two ops (a stage input, an output's
gradient, kept residuals, the B→W bridge, the batch) lives in a ring slot
`(g·v + c) mod capacity` for micro-batch g on chunk c (compile/messages.py).
The capacity is the smallest that never gives one slot to two values alive
at once, from each value's write and last read (event times). Values are
given per virtual stage j, `[S, N]`, and counted per device.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipejax import caches
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.timeline import Timeline

_NEVER = np.iinfo(np.int64).max // 2  # the write time of a value no op reads


class Capacities(NamedTuple):
    """Slots per device of each ring of a schedule's steady state."""

    inputs: int  # stage inputs
    grads: int  # received output gradients
    residuals: int  # kept residuals (0: only fused pairs)
    bridge: int  # what a split backward's B files for its W (0 without W ops)
    data: int  # micro-batches of input and targets, a multiple of M


def ring_capacities(schedule: Schedule) -> Capacities:
    """The ring capacities of `schedule`'s steady state, computed once per
    schedule (as its timelines are)."""
    def compute() -> Capacities:
        tl = schedule.steady()
        return Capacities(_inputs(tl), _grads(tl), _residuals(tl), _bridge(tl),
                          _data(tl, schedule.microbatches))

    return caches.recall(caches.CAPACITIES, schedule, compute)


def in_flight(schedule: Schedule, k: int) -> int:
    """Most micro-batch chunks device k holds at once in the steady state
    between their forward and their weight gradient: the inputs and
    residuals it stashes."""
    tl = schedule.steady()
    F, W = tl.placement.per_device(tl.F)[k], tl.placement.per_device(tl.W)[k]
    return int(max(np.sum((F <= t) & (t <= W)) for t in F))


def ring_capacity(lives: list[list[tuple[int, int]]]) -> int:
    """Smallest C such that micro-batches sharing a slot g mod C are never alive
    at once; `lives[k][g]` is (write time, last read time), both inclusive."""
    N = max((len(x) for x in lives), default=0)
    for C in range(1, N + 1):
        if all(max(a, a2) > min(b, b2)
               for per in lives for g, (a, b) in enumerate(per)
               for (a2, b2) in per[g + C::C]):
            return C
    return max(N, 1)


def _live(tl: Timeline, write: np.ndarray, read: np.ndarray) -> int:
    """Capacity for values written at `write[j, g]` and last read at
    `read[j, g]`, in the slots of their devices; read < write never lives."""
    write, read = tl.placement.per_device(write), tl.placement.per_device(read)
    return ring_capacity([list(zip(w.tolist(), r.tolist())) for w, r in zip(write, read)])


def _shift(a: np.ndarray, by: int) -> np.ndarray:
    """`a` moved by `by` virtual stages (row j gets row j − by); `_NEVER`
    where none (a value written after every read: never alive)."""
    out = np.full_like(a, _NEVER)
    if by > 0:
        out[by:] = a[:-by]
    else:
        out[:by] = a[-by:]
    return out


def _inputs(tl: Timeline) -> int:
    """Stage inputs: filed when they arrive, read up to the weight gradient
    (BW, or a split backward's W)."""
    return _live(tl, _shift(tl.arrival(tl.F), 1), tl.w_time)


def _grads(tl: Timeline) -> int:
    """Received output gradients: arrival to the input gradient."""
    return _live(tl, _shift(tl.arrival(tl.B), -1), tl.b_time)


def _residuals(tl: Timeline) -> int:
    """What a stage keeps from its forward (residuals, and with weight
    stashing the forward's weights), read up to the weight gradient; a
    fused pair keeps nothing, a table of only fused pairs no slot."""
    kept = tl.F != tl.B
    if not kept.any():
        return 0
    return _live(tl, tl.f_time, np.where(kept, tl.w_time, tl.f_time - 1))


def _bridge(tl: Timeline) -> int:
    """What a split backward's B computes for its W (the weight path's
    cotangents, Qi et al. 2024, §2): B to W; 0 without W ops."""
    split = tl.B != tl.W
    if not split.any():
        return 0
    return _live(tl, tl.b_time, np.where(split, tl.w_time, tl.b_time - 1))


def _data(tl: Timeline, M: int) -> int:
    """Micro-batches of input and targets, a multiple of M: fed before their
    step starts, read up to the first and last virtual stages' weight gradients."""
    read = np.maximum(tl.w_time[0], tl.w_time[-1])
    C = ring_capacity([list(zip((tl.unit * tl.fed - 1).tolist(), read.tolist()))])
    return -(-C // M) * M
