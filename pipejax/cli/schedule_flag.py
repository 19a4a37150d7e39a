"""--schedule: a schedule family's name (`pj.schedules.FAMILIES`), or a table in torch's CSV."""

from __future__ import annotations

import argparse

import pipejax as pj
from pipejax.cli.config import Common
from pipejax.schedules import FAMILIES, names


def schedule_name(value: str) -> str:
    """--schedule: a family's name or a path to torch's CSV."""
    if value not in FAMILIES and not value.endswith(".csv"):
        raise argparse.ArgumentTypeError(f"unknown schedule {value!r}; use one of "
                                         f"{', '.join(names())} or a path to a .csv table")
    return value


def schedule_arg(cfg: Common) -> str | pj.Schedule:
    """The schedule of --schedule: its name, or the table of a CSV file read
    for --microbatches."""
    if cfg.schedule.endswith(".csv"):
        return pj.Schedule.from_csv(cfg.schedule, microbatches=cfg.microbatches)
    return cfg.schedule


def synchronous(cfg: Common) -> bool:
    """Whether --schedule updates once per step: its family's fact, or its table's."""
    schedule = schedule_arg(cfg)
    return schedule.synchronous if isinstance(schedule, pj.Schedule) else \
        not FAMILIES[schedule].asynchronous


def updates_per_step(cfg: Common) -> int:
    """A stage's weight updates a step under --schedule (`Schedule.updates_per_step`)."""
    schedule = schedule_arg(cfg)
    if isinstance(schedule, str):  # an asynchronous family's tables run one chunk a device
        if not FAMILIES[schedule].asynchronous:
            return 1
        schedule = FAMILIES[schedule].table(cfg.stages, cfg.microbatches, 1)
    return schedule.updates_per_step
