"""Schedules as data: per (tick, stage, lane), a typed task (op, micro-batch, chunk)."""

from typing import Callable

from pipejax.errors import ConfigError
from pipejax.schedules.asynchronous import pb, pipedream
from pipejax.schedules.schedule import Schedule, StageInfo
from pipejax.schedules.tasks import NONE, Op, Task
from pipejax.schedules.timeline import Timeline
from pipejax.schedules.synchronous import gpipe, one_f_one_b

BUILDERS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "pipedream": pipedream, "pb": pb}


def make_schedule(schedule: "str | Schedule", K: int, M: int) -> Schedule:
    """A schedule by name, or a user-built `Schedule` checked against K and M."""
    if isinstance(schedule, Schedule):
        if (schedule.stages, schedule.microbatches) != (K, M):
            raise ConfigError(f"schedule {schedule.name!r} is built for K={schedule.stages}, "
                              f"M={schedule.microbatches} but the pipeline has K={K}, M={M}")
        return schedule
    if schedule not in BUILDERS:
        raise ConfigError(f"unknown schedule {schedule!r}; use one of {sorted(BUILDERS)} "
                          "or a pipejax.schedules.Schedule")
    return BUILDERS[schedule](K, M)


__all__ = ["NONE", "Op", "Schedule", "Task", "StageInfo", "Timeline", "gpipe", "make_schedule", "one_f_one_b",
           "pb", "pipedream"]
