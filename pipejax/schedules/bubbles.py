"""The bubble of a schedule: the idle share of its op slots.

`bubble_fraction` unrolls `steps` steps from an empty pipeline (and, for an
asynchronous table, the flush that drains it): over one step the fill/drain
bubble, (K−1)/(M+K−1) for GPipe (Huang et al. 2019, §2.2).
`table_bubble_fraction` reads the table as drawn (`render`, `plot`): for an
asynchronous table one period of the steady state. The closed forms a
family states for its tables (`Family.bubble`, which `pipejax bench` checks
the tables against) are the functions `(K, M, steps, v) -> (share, formula)`
below.
"""

from __future__ import annotations

from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op


def _slots(schedule: Schedule) -> int:
    """Op slots per stage and tick: the most ops one cell of the table runs."""
    return int((schedule.ops != Op.IDLE).sum(axis=2).max())


def bubble_fraction(schedule: Schedule, steps: int = 1) -> float:
    """Idle share of the op slots (one per lane the table uses, per stage and
    tick) from the first op to the last, over `steps` steps and, if
    asynchronous, the flush: for one step the fill/drain bubble,
    (K−1)/(M+K−1) for GPipe."""
    tl = schedule.timeline(steps)
    return 1.0 - tl.ops / (_slots(schedule) * schedule.stages * tl.ticks)


def table_bubble_fraction(schedule: Schedule) -> float:
    """Idle share of the op slots of the table as drawn (`render`, `plot`):
    asynchronous, one period of the steady state, where the ops of earlier
    and later steps take the slots that fill and drain leave idle (0 for pb
    and pipedream); synchronous, the whole step, `bubble_fraction`."""
    busy = int((schedule.ops != Op.IDLE).sum())
    return 1.0 - busy / (_slots(schedule) * schedule.stages * schedule.ticks)


def fill_drain(K: int, M: int, steps: int, v: int) -> tuple[float, str]:
    """A synchronous step fills and drains every step (GPipe §2), v chunks
    per device v-fold less (Narayanan et al. 2021, with K | M)."""
    return (K - 1) / (v * M + K - 1), "(K-1)/(vM+K-1)" if v > 1 else "(K-1)/(M+K-1)"


def zero_bubble_fill(K: int, M: int, steps: int, v: int) -> tuple[float, str]:
    """A zero-bubble step runs 3vM ops a device in 3vM + K − 1 ticks (Qi et
    al. 2024, ZB-H1 with F = B = W)."""
    return (K - 1) / (3 * v * M + K - 1), "(K-1)/(3vM+K-1)"


def fills_once(K: int, M: int, steps: int, v: int) -> tuple[float, str]:
    """PipeDream fills once over `steps` steps and its flush."""
    return (K - 1) / (steps * M + K - 1), "(K-1)/(nM+K-1)"


def pb_fill(K: int, M: int, steps: int, v: int) -> tuple[float, str]:
    """PB fills once, and its backward lane also waits K − 1 ticks for its
    first gradient."""
    return 2 * (K - 1) / (steps * M + 2 * (K - 1)), "2(K-1)/(nM+2(K-1))"
