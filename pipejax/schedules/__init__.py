"""Schedules as data: per (tick, stage, lane), a typed task (op, micro-batch, chunk).

The builders, their families (`FAMILIES`: what a name means; `register` a
user's own), `make_schedule` (a table by name), and what is read off a
`Schedule`: its bubble, its ring capacities and its pictures."""

from pipejax.errors import ConfigError, ScheduleError
from pipejax.placement import Placement
from pipejax.schedules.asynchronous import pb, pipedream
from pipejax.schedules.bubbles import bubble_fraction, table_bubble_fraction
from pipejax.schedules.capacities import Capacities, in_flight, ring_capacities
from pipejax.schedules.families import FAMILIES, Family, family, names, register, unregister
from pipejax.schedules.interleaved import gpipe_virtual, interleaved
from pipejax.schedules.pictures import plot, render
from pipejax.schedules.schedule import Schedule, StageInfo
from pipejax.schedules.synchronous import gpipe, one_f_one_b
from pipejax.schedules.tasks import NONE, Op, Task
from pipejax.schedules.timeline import Timeline
from pipejax.schedules.v_shape import dualpipev, zb_v
from pipejax.schedules.zero_bubble import zb_h1, zb_h2


def placement_for(schedule: "str | Schedule", stages: int, virtual: int | None,
                  kind: str | None) -> Placement:
    """The placement a pipeline runs `schedule` on: a table's own (what the
    caller gives must agree, checked by `make_schedule`), else its family's
    placement with `virtual` chunks per device (default: the family's)."""
    if isinstance(schedule, Schedule):
        have = schedule.placement
        return Placement(stages, have.virtual if virtual is None else virtual,
                         have.kind if kind is None else kind)
    named = family(schedule)
    return Placement(stages, named.virtual if virtual is None else virtual,
                     kind or named.placement)


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
    named = family(schedule)
    if named.placement != placement.kind:  # the chunks it takes: `Family.table` checks them
        on_v = sorted(n for n, f in FAMILIES.items() if f.placement == "v")
        raise ConfigError(f"schedule {schedule!r} runs on {named.runs()}, not on {placement}; "
                          f"V placement runs {on_v} and tables read with pj.Schedule.from_csv")
    return named.table(K, M, v)


__all__ = ["FAMILIES", "NONE", "Capacities", "Family", "Op", "Schedule", "Task", "StageInfo",
           "Timeline", "bubble_fraction", "dualpipev", "family", "gpipe", "gpipe_virtual",
           "in_flight", "interleaved", "make_schedule", "names", "one_f_one_b", "pb", "pipedream",
           "placement_for", "plot", "register", "render", "ring_capacities",
           "table_bubble_fraction", "unregister", "zb_h1", "zb_h2", "zb_v"]
