"""A schedule table unrolled over steps: the global tick of every op.

Everything derived from a table (buffer capacities, delays, horizons,
bubbles) is read off this unrolled form, never written by hand. An
asynchronous table (one period) is repeated for `steps` steps and then for
periods with no new input until every micro-batch fed has finished.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipejax.errors import ScheduleError

NONE = -(1 << 30)  # no op in this lane


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The table unrolled over `steps` steps (and the flush that follows, for
    an asynchronous table): global ticks of every op of every micro-batch."""

    F: np.ndarray  # [K, N] tick of the forward of micro-batch g on stage k
    B: np.ndarray  # [K, N] tick of the backward
    fed: np.ndarray  # [N] tick before whose start micro-batch g's data is available
    ticks: int  # ticks from the first op to the last


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


def unroll(name: str, fwd: np.ndarray, bwd: np.ndarray, M: int, asynchronous: bool,
           steps: int) -> Timeline:
    """The ticks of every op of every micro-batch fed in `steps` steps."""
    T, K = fwd.shape
    N = M * (steps if asynchronous else 1)
    F, B = np.full((K, N), -1, np.int64), np.full((K, N), -1, np.int64)
    seen_f, seen_b = np.zeros((K, N), np.int64), np.zeros((K, N), np.int64)
    periods = steps if asynchronous else 1
    s = 0
    while True:
        for lane, out, seen in ((fwd, F, seen_f), (bwd, B, seen_b)):
            t, k = np.nonzero(lane != NONE)
            g = s * M + lane[t, k]
            ok = (g >= 0) & (g < N)
            out[k[ok], g[ok]] = s * T + t[ok]
            np.add.at(seen, (k[ok], g[ok]), 1)
        s += 1
        if s >= periods and ((B >= 0).all() or s > periods + 4 * (K + T) + 4):
            break
    bad = np.argwhere((seen_f != 1) | (seen_b != 1))
    if len(bad):
        k, g = bad[0]
        lane = "forward" if seen_f[k, g] != 1 else "backward"
        count = seen_f[k, g] if lane == "forward" else seen_b[k, g]
        raise ScheduleError(
            f"schedule {name!r}: stage {k} runs the {lane} of micro-batch {g} {count} "
            "times; every micro-batch needs exactly one forward and one backward on every stage")
    fed = (np.arange(N) // M) * T if asynchronous else np.zeros(N, np.int64)
    first = min(F.min(), B.min())
    return Timeline(F, B, fed, int(max(F.max(), B.max()) - first + 1))
