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
from pipejax.schedules.tasks import BACKWARD, NONE, Op


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The table unrolled over `steps` steps (and the flush that follows, for
    an asynchronous table): global ticks and event times of every op of
    every micro-batch. An event time orders what happens within a tick: the
    op of lane l of tick t happens at `unit·t + l + 1`, the messages of tick
    t arrive at `unit·t + lanes + 1` (`unit = lanes + 2`)."""

    F: np.ndarray  # [K, N] tick of the forward of micro-batch g on stage k
    B: np.ndarray  # [K, N] tick of the backward
    f_time: np.ndarray  # [K, N] event time of the forward
    b_time: np.ndarray  # [K, N] event time of the backward
    fed: np.ndarray  # [N] tick before whose start micro-batch g's data is available
    ticks: int  # ticks from the first op to the last
    unit: int  # event times per tick

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


def ring_capacity(lives: list[list[tuple[int, int]]]) -> int:
    """Smallest C such that micro-batches sharing a slot g mod C are never alive
    at once; `lives[k][g]` is (write time, last read time), both inclusive."""
    N = max((len(x) for x in lives), default=0)
    for C in range(1, N + 1):
        if all(max(a, a2) > min(b, b2)
               for per in lives for g, (a, b) in enumerate(per)
               for (a2, b2) in per[g + C::C]):
            return C
    return max(N, 1)


def unroll(name: str, table: np.ndarray, M: int, asynchronous: bool, steps: int) -> Timeline:
    """The ticks of every op of every micro-batch fed in `steps` steps (and,
    asynchronous, the `lifetime` periods that drain them)."""
    T, K, lanes, _ = table.shape
    unit = lanes + 2
    N = M * (steps if asynchronous else 1)
    periods = steps + lifetime(table[..., 1], M) if asynchronous else 1
    ticks = {op: np.full((K, N), -1, np.int64) for op in ("F", "B")}
    times = {op: np.full((K, N), -1, np.int64) for op in ("F", "B")}
    seen = {op: np.zeros((K, N), np.int64) for op in ("F", "B")}
    kinds = {"F": np.isin(table[..., 0], [Op.F]), "B": np.isin(table[..., 0], BACKWARD)}
    for s in range(periods):
        for op, mask in kinds.items():
            t, k, lane = np.nonzero(mask)
            g = s * M + table[t, k, lane, 1]
            ok = (g >= 0) & (g < N)
            ticks[op][k[ok], g[ok]] = s * T + t[ok]
            times[op][k[ok], g[ok]] = unit * (s * T + t[ok]) + lane[ok] + 1
            np.add.at(seen[op], (k[ok], g[ok]), 1)
    bad = np.argwhere((seen["F"] != 1) | (seen["B"] != 1))
    if len(bad):
        k, g = bad[0]
        op = "F" if seen["F"][k, g] != 1 else "B"
        raise ScheduleError(
            f"schedule {name!r}: stage {k} runs the {'forward' if op == 'F' else 'backward'} of "
            f"micro-batch {g} {seen[op][k, g]} times; every micro-batch needs exactly one forward "
            "and one backward on every stage")
    F, B = ticks["F"], ticks["B"]
    fed = (np.arange(N) // M) * T if asynchronous else np.zeros(N, np.int64)
    first = min(F.min(), B.min())
    return Timeline(F, B, times["F"], times["B"], fed, int(max(F.max(), B.max()) - first + 1), unit)
