"""A schedule table unrolled over steps: the global tick of every op.

(An asynchronous table's period and drain are derived here, by `lifetime`.)

Everything derived from a table (buffer capacities, delays, horizons,
bubbles) is read off this unrolled form, never written by hand. An
asynchronous table (one period) is repeated for `steps` steps and then for
periods with no new input until every micro-batch fed has finished.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.placement import Placement
from pipejax.schedules.tasks import BACKWARD, NONE, WEIGHTS, Op


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The table unrolled over `steps` steps (and the flush that follows, for
    an asynchronous table): global ticks and event times of every op of
    every micro-batch on every virtual stage j (local chunk c of device k,
    as the table's `Placement` maps them). An event time orders what happens within a
    tick: the op of lane l of tick t happens at `unit·t + l + 1`, the
    messages of tick t arrive at `unit·t + lanes + 1` (`unit = lanes + 2`).
    `B` is the op that sends the input gradient back (B or the fused BW),
    `W` the one that makes the weight gradient (W, or BW: then W == B)."""

    F: np.ndarray  # [S, N] tick of the forward of micro-batch g on virtual stage j
    B: np.ndarray  # [S, N] tick of the input gradient
    W: np.ndarray  # [S, N] tick of the weight gradient
    f_time: np.ndarray  # [S, N] event time of the forward
    b_time: np.ndarray  # [S, N] event time of the input gradient
    w_time: np.ndarray  # [S, N] event time of the weight gradient
    fed: np.ndarray  # [N] tick before whose start micro-batch g's data is available
    ticks: int  # ticks from the first op to the last
    unit: int  # event times per tick
    ops: int  # ops run (a split backward counts two)
    placement: Placement  # which device holds each virtual stage

    def arrival(self, ticks: np.ndarray) -> np.ndarray:
        """Event time at which the messages sent at `ticks` are filed."""
        return self.unit * ticks + self.unit - 1


def lifetime(microbatch: np.ndarray, M: int) -> int:
    """Periods an asynchronous pipeline keeps a micro-batch after the one
    that feeds it, read off one period's table: in period p, relative id r
    names micro-batch p·M + r, fed in period p + ⌊r/M⌋, so the oldest op of
    the table, of relative id r_min, runs −⌊r_min/M⌋ periods after its
    micro-batch was fed. A flush runs that many periods; the middle step of
    2·lifetime + 1 steps sees the steady state on both sides."""
    ids = microbatch[microbatch != NONE]
    return int(-np.floor_divide(ids.min(), M)) if ids.size else 0


def unroll(name: str, table: np.ndarray, placement: Placement, M: int, asynchronous: bool,
           steps: int) -> Timeline:
    """The ticks of every op of every micro-batch fed in `steps` steps (and,
    asynchronous, the `lifetime` periods that drain them)."""
    T, K, lanes, _ = table.shape
    S = placement.chunks
    unit = lanes + 2
    N = M * (steps if asynchronous else 1)
    periods = steps + lifetime(table[..., 1], M) if asynchronous else 1
    kinds = {"F": (Op.F,), "B": BACKWARD, "W": WEIGHTS}
    ticks = {op: np.full((S, N), -1, np.int64) for op in kinds}
    times = {op: np.full((S, N), -1, np.int64) for op in kinds}
    seen = {op: np.zeros((S, N), np.int64) for op in kinds}
    for s in range(periods):
        for op, which in kinds.items():
            t, k, lane = np.nonzero(np.isin(table[..., 0], which))
            g = s * M + table[t, k, lane, 1]
            j = placement.chunk(k, table[t, k, lane, 2])
            ok = (g >= 0) & (g < N)
            ticks[op][j[ok], g[ok]] = s * T + t[ok]
            times[op][j[ok], g[ok]] = unit * (s * T + t[ok]) + lane[ok] + 1
            np.add.at(seen[op], (j[ok], g[ok]), 1)
    for op, what in (("F", "forward"), ("B", "input gradient (B or BW)"),
                     ("W", "weight gradient (W or BW)")):
        bad = np.argwhere(seen[op] != 1)
        if len(bad):
            j, g = bad[0]
            where = placement.name(j)
            raise ScheduleError(
                f"schedule {name!r}: {where} runs the {what} of micro-batch {g} {seen[op][j, g]} "
                "times; every micro-batch needs exactly one forward, one input gradient and one "
                "weight gradient on every stage")
    F, B, W = ticks["F"], ticks["B"], ticks["W"]
    fed = (np.arange(N) // M) * T if asynchronous else np.zeros(N, np.int64)
    first = min(F.min(), B.min())
    split = int((B != W).sum())
    return Timeline(F, B, W, times["F"], times["B"], times["W"], fed,
                    int(max(F.max(), W.max()) - first + 1), unit, F.size + B.size + split,
                    placement)
