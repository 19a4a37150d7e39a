"""Schedules as data: per (tick, stage, lane), a typed task (op, micro-batch, chunk).

The builders, `make_schedule` (a table by name), and what is read off a
`Schedule`: its bubble, its ring capacities and its pictures."""

from typing import Callable

from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules.asynchronous import pb, pipedream
from pipejax.schedules.bubbles import bubble_fraction, table_bubble_fraction
from pipejax.schedules.capacities import Capacities, in_flight, ring_capacities
from pipejax.schedules.interleaved import gpipe_virtual, interleaved
from pipejax.schedules.pictures import plot, render
from pipejax.schedules.schedule import Schedule, StageInfo
from pipejax.schedules.synchronous import gpipe, one_f_one_b
from pipejax.schedules.tasks import NONE, Op, Task
from pipejax.schedules.timeline import Timeline
from pipejax.schedules.zero_bubble import zb_h1, zb_h2

# name -> (K, M, v) -> table; v = 1 only where the value is None for v > 1.
BUILDERS: dict[str, tuple[Callable[[int, int], Schedule], Callable[..., Schedule] | None]] = {
    "gpipe": (gpipe, gpipe_virtual), "1f1b": (one_f_one_b, None),
    "interleaved": (lambda K, M: interleaved(K, M, 1), interleaved),
    "zb-h1": (zb_h1, zb_h1), "zb-h2": (zb_h2, zb_h2), "pipedream": (pipedream, None),
    "pb": (pb, None)}

_NO_VIRTUAL = {
    "1f1b": "1F1B over virtual stages is 'interleaved'",
    "pipedream": "asynchronous tables run one chunk per device: each stage updates its weights "
                 "after every backward, and with v chunks a device would hold v optimizer stages "
                 "with delays of their own, while the per-stage optimizers are one per device",
    "pb": "asynchronous tables run one chunk per device (see 'pipedream')"}


def make_schedule(schedule: "str | Schedule", placement: Placement, M: int) -> Schedule:
    """A schedule by name for the devices and chunks of `placement` and M
    micro-batches, or a user-built `Schedule` checked against them."""
    K, v = placement.stages, placement.virtual
    if isinstance(schedule, Schedule):
        if (schedule.placement, schedule.microbatches) != (placement, M):
            have = schedule.placement
            raise ConfigError(f"schedule {schedule.name!r} is built for K={have.stages}, "
                              f"M={schedule.microbatches}, virtual={have.virtual} but the "
                              f"pipeline has K={K}, M={M}, virtual={v}")
        return schedule
    if schedule not in BUILDERS:
        raise ConfigError(f"unknown schedule {schedule!r}; use one of {sorted(BUILDERS)} "
                          "or a pipejax.schedules.Schedule")
    plain, virtual = BUILDERS[schedule]
    if v == 1:
        return plain(K, M)
    if virtual is None:
        raise ConfigError(f"schedule {schedule!r} does not run virtual={v}: "
                          f"{_NO_VIRTUAL[schedule]}; use virtual=1, or one of "
                          f"{sorted(n for n, (_, b) in BUILDERS.items() if b is not None)}")
    return virtual(K, M, v)


__all__ = ["NONE", "Capacities", "Op", "Schedule", "Task", "StageInfo", "Timeline",
           "bubble_fraction", "gpipe", "gpipe_virtual", "in_flight", "interleaved",
           "make_schedule", "one_f_one_b", "pb", "pipedream", "plot", "render", "ring_capacities",
           "table_bubble_fraction", "zb_h1", "zb_h2"]
