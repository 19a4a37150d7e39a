"""--schedule: a schedule's name (`pj.schedules.NAMES`), or a table in torch's CSV."""

from __future__ import annotations

import argparse

import pipejax as pj
from pipejax.schedules import ASYNCHRONOUS, NAMES


def schedule_name(value: str) -> str:
    """--schedule: a schedule's name or a path to torch's CSV."""
    if value not in NAMES and not value.endswith(".csv"):
        raise argparse.ArgumentTypeError(f"unknown schedule {value!r}; use one of "
                                         f"{', '.join(NAMES)} or a path to a .csv table")
    return value


def schedule_arg(args) -> str | pj.Schedule:
    """The schedule of --schedule: its name, or the table of a CSV file read
    for --microbatches."""
    if args.schedule.endswith(".csv"):
        return pj.Schedule.from_csv(args.schedule, microbatches=args.microbatches)
    return args.schedule


def synchronous(args) -> bool:
    """Whether --schedule updates once per step (every table but pipedream's and pb's)."""
    return args.schedule not in ASYNCHRONOUS
