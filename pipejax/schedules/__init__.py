"""Schedules as data: per (tick, stage, lane), a typed task (op, micro-batch, chunk).

The builders, `make_schedule` (a table by name), and what is read off a
`Schedule`: its bubble, its ring capacities and its pictures."""

from typing import Callable

from pipejax.errors import ConfigError, ScheduleError
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
from pipejax.schedules.v_shape import dualpipev, zb_v
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


# name -> (K, M) -> table on the V placement, two chunks per device.
V_BUILDERS: dict[str, Callable[[int, int], Schedule]] = {"zb-v": zb_v, "dualpipev": dualpipev}
NAMES = tuple(sorted([*BUILDERS, *V_BUILDERS]))  # every schedule by name
ASYNCHRONOUS = ("pb", "pipedream")  # the names whose tables never drain (asynchronous.py)


def placement_for(schedule: "str | Schedule", stages: int, virtual: int | None,
                  kind: str | None) -> Placement:
    """The placement a pipeline runs `schedule` on: a table's own (what the
    caller gives must agree, checked by `make_schedule`), two chunks in a V
    for the V schedules, else `virtual` (default 1) chunks in a loop."""
    if isinstance(schedule, Schedule):
        have = schedule.placement
        return Placement(stages, have.virtual if virtual is None else virtual,
                         have.kind if kind is None else kind)
    if schedule in V_BUILDERS:
        return Placement(stages, 2 if virtual is None else virtual, kind or "v")
    return Placement(stages, 1 if virtual is None else virtual, kind or "loop")


def make_schedule(schedule: "str | Schedule", placement: Placement, M: int) -> Schedule:
    """A schedule by name for the devices and chunks of `placement` and M
    micro-batches, or a user-built `Schedule` checked against them."""
    K, v = placement.stages, placement.virtual
    if isinstance(schedule, Schedule):
        have = schedule.placement
        table = {"stages": have.stages, "microbatches": schedule.microbatches,
                 "virtual": have.virtual, "placement": have.kind}
        given = {"stages": K, "microbatches": M, "virtual": v, "placement": placement.kind}
        differ = [f"{k}={table[k]!r} (the pipeline's {given[k]!r})" for k in table
                  if table[k] != given[k]]
        if differ:
            raise ScheduleError(
                f"schedule {schedule.name!r} is built for {', '.join(differ)}; give the "
                "table's stages and microbatches, and leave virtual and placement out: "
                "pj.pipeline takes them from the table")
        return schedule
    if schedule not in NAMES:
        raise ConfigError(f"unknown schedule {schedule!r}; use one of {list(NAMES)} "
                          "or a pipejax.schedules.Schedule")
    if (schedule in V_BUILDERS) != (placement.kind == "v") or (
            schedule in V_BUILDERS and v != 2):
        runs = "placement='v' with virtual=2" if schedule in V_BUILDERS else "placement='loop'"
        raise ConfigError(f"schedule {schedule!r} runs on {runs}, not on {placement}; "
                          f"V placement runs {sorted(V_BUILDERS)} and tables read with "
                          "pj.Schedule.from_csv")
    if schedule in V_BUILDERS:
        return V_BUILDERS[schedule](K, M)
    plain, virtual = BUILDERS[schedule]
    if v == 1:
        return plain(K, M)
    if virtual is None:
        raise ConfigError(f"schedule {schedule!r} does not run virtual={v}: "
                          f"{_NO_VIRTUAL[schedule]}; use virtual=1, or one of "
                          f"{sorted(n for n, (_, b) in BUILDERS.items() if b is not None)}")
    return virtual(K, M, v)


__all__ = ["ASYNCHRONOUS", "NAMES", "NONE", "Capacities", "Op", "Schedule", "Task", "StageInfo",
           "Timeline", "bubble_fraction", "dualpipev", "gpipe", "gpipe_virtual", "in_flight", "interleaved",
           "make_schedule", "one_f_one_b", "pb", "pipedream", "placement_for", "plot", "render",
           "ring_capacities", "table_bubble_fraction", "zb_h1", "zb_h2", "zb_v"]
