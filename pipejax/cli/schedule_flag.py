"""--schedule: a schedule's name, or a table in torch's CSV.

The flags are parsed before JAX is imported (to set the simulated device
count first), so the names are listed here; tests/test_cli.py keeps them
equal to `pj.schedules.make_schedule`'s.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pipejax as pj

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "pipedream",
             "pb")
ASYNCHRONOUS = ("pipedream", "pb")


def schedule_name(value: str) -> str:
    """--schedule: a schedule's name or a path to torch's CSV."""
    if value not in SCHEDULES and not value.endswith(".csv"):
        raise argparse.ArgumentTypeError(f"unknown schedule {value!r}; use one of "
                                         f"{', '.join(SCHEDULES)} or a path to a .csv table")
    return value


def schedule_arg(args) -> "str | pj.Schedule":
    """The schedule of --schedule: its name, or the table of a CSV file read
    for --microbatches."""
    import pipejax as pj

    if args.schedule.endswith(".csv"):
        return pj.Schedule.from_csv(args.schedule, microbatches=args.microbatches)
    return args.schedule


def synchronous(args) -> bool:
    """Whether --schedule updates once per step (every table but pipedream's and pb's)."""
    return args.schedule not in ASYNCHRONOUS
