"""What makes a schedule table valid, checked when a `Schedule` is made.

`check_tasks` rejects cells the executor cannot run (unknown ops, two
forwards, two input gradients or two weight gradients in one cell, a
negative chunk, chunks in an asynchronous table, a placement of another
stage count or fewer chunks than the table names); `check_order` rejects
impossible orders (an op before its input or gradient exists, a backward
before its forward, a split B or W not at a later tick than what it reads),
naming the tick, stage and micro-batch.
"""

from __future__ import annotations

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.placement import Placement
from pipejax.schedules.tasks import BACKWARD, NONE, WEIGHTS, Op
from pipejax.schedules.timeline import Timeline

# Why an asynchronous table runs one chunk per device.
ONE_CHUNK = ("each stage updates its weights after every backward, and with v chunks a device "
             "would hold v optimizer stages with delays of their own, while the per-stage "
             "optimizers are one per device")

def check_tasks(name: str, table: np.ndarray, placement: Placement, asynchronous: bool) -> None:
    """Reject unknown ops, a cell with two ops of one kind, negative chunks,
    and chunks in an asynchronous table."""
    ops = table[..., 0]
    if not np.isin(ops, [int(o) for o in Op]).all():
        t, k, lane = np.argwhere(~np.isin(ops, [int(o) for o in Op]))[0]
        raise ScheduleError(f"schedule {name!r}: tick {t}, stage {k}, lane {lane} has op "
                            f"{ops[t, k, lane]}; use one of {[o.name for o in Op]}")
    busy, ids = ops != Op.IDLE, table[..., 1]
    if (ids[busy] == NONE).any() or (ids[~busy] != NONE).any():
        raise ScheduleError(f"schedule {name!r}: a busy task needs a micro-batch and an "
                            "idle one none")
    for kind, what in (((Op.F,), "forwards"), (BACKWARD, "input gradients (B, BW)"),
                       (WEIGHTS, "weight gradients (W, BW)")):
        per_cell = np.isin(ops, kind).sum(axis=2)
        if (per_cell > 1).any():
            t, k = np.argwhere(per_cell > 1)[0]
            raise ScheduleError(f"schedule {name!r}: tick {t}, stage {k} runs two "
                                f"{what}; a tick holds one of each")
    local = table[..., 2]  # each task's chunk among its device's
    if (local < 0).any():
        t, k, lane = np.argwhere(local < 0)[0]
        raise ScheduleError(f"schedule {name!r}: tick {t}, stage {k}, lane {lane} names "
                            f"chunk {local[t, k, lane]}; chunks count from 0")
    if asynchronous and np.isin(ops, (Op.B, Op.W)).any():
        raise ScheduleError(
            f"schedule {name!r}: an asynchronous table runs fused backwards (BW): its "
            "stages update their weights right after each backward, so there is no W to defer")
    if asynchronous and (local != 0).any():
        raise ScheduleError(
            f"schedule {name!r}: an asynchronous table with virtual stages is not run: "
            f"{ONE_CHUNK}; use virtual=1 for an asynchronous table")
    if placement.stages != table.shape[1]:
        raise ScheduleError(f"schedule {name!r}: the table has {table.shape[1]} stages "
                            f"but its placement {placement.stages}; give "
                            f"placement=pj.Placement({table.shape[1]}, v)")
    if (local >= placement.virtual).any():
        t, k, lane = np.argwhere(local >= placement.virtual)[0]
        raise ScheduleError(f"schedule {name!r}: tick {t}, stage {k}, lane {lane} names "
                            f"chunk {local[t, k, lane]} but its placement holds "
                            f"{placement.virtual} chunk(s) per device; give "
                            f"placement=pj.Placement({table.shape[1]}, "
                            f"{int(local.max()) + 1}) with the table")


def check_order(name: str, table: np.ndarray, M: int, asynchronous: bool, tl: Timeline) -> None:
    """Reject an impossible table, naming the tick, stage and micro-batch."""
    T = table.shape[0]
    step = lambda tick: f" of step {tick // T}" if asynchronous else ""
    where = lambda tick: f"tick {tick % T}" + step(tick)
    ids = table[..., 1]
    bad = (ids != NONE) & (((ids < 0) & (not asynchronous)) | (ids >= M))
    if bad.any():
        t, k, _ = np.argwhere(bad)[0]
        span = f"below {M} (negative: fed earlier)" if asynchronous else f"0..{M - 1}"
        raise ScheduleError(f"schedule {name!r}: tick {t}, stage {k} names "
                            f"micro-batch {ids[bad][0]} outside {span}")
    F, B = tl.F, tl.B
    S = F.shape[0]
    stage = tl.placement.name
    for j in range(1, S):
        for g in range(F.shape[1]):
            if F[j, g] <= F[j - 1, g]:
                raise ScheduleError(
                    f"schedule {name!r}: {where(F[j, g])}, {stage(j)} runs the forward of "
                    f"micro-batch {g} before its input exists ({stage(j - 1)} sends it at "
                    f"{where(F[j - 1, g])})")
    for j in range(S):
        for g in range(F.shape[1]):
            if tl.b_time[j, g] < tl.f_time[j, g]:
                raise ScheduleError(
                    f"schedule {name!r}: {where(B[j, g])}, {stage(j)} runs the backward of "
                    f"micro-batch {g} before its forward ({where(F[j, g])})")
            split = tl.w_time[j, g] != tl.b_time[j, g]  # B and W, not one BW
            if split and tl.W[j, g] <= B[j, g]:
                raise ScheduleError(
                    f"schedule {name!r}: {where(tl.W[j, g])}, {stage(j)} runs the weight "
                    f"gradient (W) of micro-batch {g} no later than its input gradient (B, "
                    f"{where(B[j, g])}); W reads what B files: run W at a later tick")
            if split and B[j, g] == F[j, g]:
                raise ScheduleError(
                    f"schedule {name!r}: {where(B[j, g])}, {stage(j)} runs the input "
                    f"gradient (B) of micro-batch {g} in the tick of its forward; B reads the "
                    "residuals the forward keeps: run B at a later tick (or fuse it, BW)")
            if j < S - 1 and B[j, g] <= B[j + 1, g]:
                raise ScheduleError(
                    f"schedule {name!r}: {where(B[j, g])}, {stage(j)} runs the backward of "
                    f"micro-batch {g} before {stage(j + 1)} sends its gradient "
                    f"({where(B[j + 1, g])})")


def check_versions(name: str, tl: Timeline, M: int) -> None:
    """Reject a double-buffered table that two weight versions cannot run
    (PipeDream-2BW, Narayanan et al. 2021, §3.1): at every stage the last
    micro-batch of a step must send its gradient after the step's others
    and before the next step's (its backward updates, once a step), and no
    op of step j + 1 may run before step j − 1's update (the stage then
    holds W(j − 1) and W(j) only: it needs M ≥ K − 1 micro-batches a step)."""
    S, N = tl.b_time.shape
    steps = N // M
    stage = tl.placement.name
    for j in range(S):
        last = lambda n: tl.b_time[j, (n + 1) * M - 1]
        for n in range(steps):
            ids = range(n * M, (n + 1) * M)
            if max(tl.b_time[j, g] for g in ids) > last(n) or (
                    n + 1 < steps and min(tl.b_time[j, g + M] for g in ids) < last(n)):
                raise ScheduleError(
                    f"schedule {name!r}: {stage(j)} sends the gradient of micro-batch "
                    f"{(n + 1) * M - 1}, the last of its step, out of the step's order; a "
                    "double-buffered table updates there once a step: run a step's backwards "
                    "before the next step's, its last id last")
            if n + 2 < steps:
                first = min(min(tl.f_time[j, g], tl.b_time[j, g])
                            for g in range((n + 2) * M, (n + 3) * M))
                if first < last(n):
                    raise ScheduleError(
                        f"schedule {name!r}: {stage(j)} runs step {n + 2} before step {n}'s "
                        f"update, which makes the version W({n + 1}) step {n + 2} runs on, "
                        f"with {M} micro-batches a step; use more micro-batches a step "
                        "(M >= K - 1 on PipeDream's ticks)")
