"""What makes a schedule table valid, checked when a `Schedule` is made.

`check_tasks` rejects cells the executor cannot run (unknown ops, two
forwards or two backwards in one cell, split backwards and chunks not yet
run); `check_order` rejects impossible orders (an op before its input or
gradient exists, a backward before its forward), naming the tick, stage and
micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.schedules.tasks import BACKWARD, NONE, Op

if TYPE_CHECKING:
    from pipejax.schedules.schedule import Schedule


def check_tasks(schedule: Schedule) -> None:
    """Reject unknown ops, a cell with two forwards or two backwards, and
    what the executor does not run yet (the split backward, chunks)."""
    ops = schedule.ops
    if not np.isin(ops, [int(o) for o in Op]).all():
        t, k, lane = np.argwhere(~np.isin(ops, [int(o) for o in Op]))[0]
        raise ScheduleError(f"schedule {schedule.name!r}: tick {t}, stage {k}, lane {lane} has op "
                            f"{ops[t, k, lane]}; use one of {[o.name for o in Op]}")
    busy, ids = ops != Op.IDLE, schedule.table[..., 1]
    if (ids[busy] == NONE).any() or (ids[~busy] != NONE).any():
        raise ScheduleError(f"schedule {schedule.name!r}: a busy task needs a micro-batch and an "
                            "idle one none")
    for kind, what in (((Op.F,), "forwards"), (BACKWARD, "backwards")):
        per_cell = np.isin(ops, kind).sum(axis=2)
        if (per_cell > 1).any():
            t, k = np.argwhere(per_cell > 1)[0]
            raise ScheduleError(f"schedule {schedule.name!r}: tick {t}, stage {k} runs two "
                                f"{what}; a tick holds one of each")
    split = np.isin(ops, (Op.B, Op.W))
    if split.any() or (schedule.table[..., 2] != 0).any():
        raise ScheduleError(f"schedule {schedule.name!r}: split backwards (B, W) and model chunks "
                            "(virtual stages) are not run by this executor yet; use fused BW "
                            "tasks on chunk 0")


def check_order(schedule: Schedule) -> None:
    """Reject an impossible table, naming the tick, stage and micro-batch."""
    K, M, T = schedule.stages, schedule.microbatches, schedule.ticks
    step = lambda tick: f" of step {tick // T}" if schedule.asynchronous else ""
    where = lambda tick: f"tick {tick % T}" + step(tick)
    ids = schedule.table[..., 1]
    bad = (ids != NONE) & (((ids < 0) & schedule.synchronous) | (ids >= M))
    if bad.any():
        t, k, _ = np.argwhere(bad)[0]
        span = f"0..{M - 1}" if schedule.synchronous else f"below {M} (negative: fed earlier)"
        raise ScheduleError(f"schedule {schedule.name!r}: tick {t}, stage {k} names "
                            f"micro-batch {ids[bad][0]} outside {span}")
    tl = schedule.timeline(3 if schedule.asynchronous else 1)
    F, B = tl.F, tl.B
    for k in range(1, K):
        for g in range(F.shape[1]):
            if F[k, g] <= F[k - 1, g]:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: {where(F[k, g])}, stage {k} runs the forward of "
                    f"micro-batch {g} before its input exists (stage {k - 1} sends it at "
                    f"{where(F[k - 1, g])})")
    for k in range(K):
        for g in range(F.shape[1]):
            if tl.b_time[k, g] < tl.f_time[k, g]:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: {where(B[k, g])}, stage {k} runs the backward of "
                    f"micro-batch {g} before its forward ({where(F[k, g])})")
            if k < K - 1 and B[k, g] <= B[k + 1, g]:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: {where(B[k, g])}, stage {k} runs the backward of "
                    f"micro-batch {g} before stage {k + 1} sends its gradient "
                    f"({where(B[k + 1, g])})")
