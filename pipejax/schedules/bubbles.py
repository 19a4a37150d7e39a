"""The bubble of a schedule: the idle share of its op slots.

`bubble_fraction` unrolls `steps` steps from an empty pipeline (and, for an
asynchronous table, the flush that drains it): over one step the fill/drain
bubble, (K−1)/(M+K−1) for GPipe (Huang et al. 2019, §2.2).
`table_bubble_fraction` reads the table as drawn (`render`, `plot`): for an
asynchronous table one period of the steady state.
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
