"""Schedules as data: tables of (op, micro-batch) per (tick, stage)."""

from typing import Callable

from pipejax.errors import ConfigError
from pipejax.schedules.gpipe import gpipe
from pipejax.schedules.schedule import BWD, FWD, IDLE, Schedule, StageInfo

BUILDERS: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe}


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


__all__ = ["BWD", "FWD", "IDLE", "Schedule", "StageInfo", "gpipe", "make_schedule"]
