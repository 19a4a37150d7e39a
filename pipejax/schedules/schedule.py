"""A schedule is data: a `[ticks, stages]` table of (op, micro-batch).

In the spirit of JaxPP's task lists, a `Schedule` can be printed, checked
and measured without running a model; the executor runs any valid table.
Everything the executor needs to size its buffers (ring-buffer capacities)
and everything the optimizer needs to know (per-stage delay) is derived from
the table here, never written by hand.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from pipejax.errors import ScheduleError

IDLE, FWD, BWD = 0, 1, 2
_OP_LETTER = {IDLE: ".", FWD: "F", BWD: "B"}


class StageInfo(NamedTuple):
    """What a per-stage optimizer may depend on: its place and its staleness."""

    stage: int  # k, counted from 0
    stages: int  # K
    delay: int  # D: weight updates between a micro-batch's forward and backward here
    forward_horizon: int  # updates until this stage's forward weights are used in the backward
    backward_horizon: int


def _ring_capacity(intervals: list[list[tuple[int, int]]], M: int) -> int:
    """Smallest C such that micro-batches m and m' with m ≡ m' (mod C) are never
    alive at once in the same stage's buffer. An interval [write, last_read)
    is written at the end of tick `write` and read during `last_read`."""
    for C in range(1, M + 1):
        ok = True
        for per_stage in intervals:
            for m, (a, b) in enumerate(per_stage):
                for m2 in range(m + C, M, C):
                    a2, b2 = per_stage[m2]
                    if a < b2 and a2 < b:
                        ok = False
                        break
                if not ok:
                    break
            if not ok:
                break
        if ok:
            return C
    return max(M, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A table of ops: `ops[t, k]` ∈ {IDLE, FWD, BWD} on micro-batch `mb[t, k]`.

    `synchronous` schedules apply one optimizer update per step after all
    micro-batches (GPipe, 1F1B); their delays are zero.
    """

    name: str
    ops: np.ndarray  # [ticks, K] int
    mb: np.ndarray  # [ticks, K] int
    microbatches: int
    synchronous: bool = True

    def __post_init__(self):
        ops, mb = np.asarray(self.ops, np.int32), np.asarray(self.mb, np.int32)
        if ops.ndim != 2 or ops.shape != mb.shape:
            raise ScheduleError(f"schedule {self.name!r}: ops {ops.shape} and mb {mb.shape} "
                                "must both be [ticks, stages]")
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "mb", mb)
        self.validate()

    @property
    def ticks(self) -> int:
        return self.ops.shape[0]

    @property
    def stages(self) -> int:
        return self.ops.shape[1]

    def tick_of(self, op: int) -> np.ndarray:
        """`[K, M]` tick at which stage k runs `op` on micro-batch m."""
        out = np.full((self.stages, self.microbatches), -1, np.int64)
        t, k = np.nonzero(self.ops == op)
        out[k, self.mb[t, k]] = t
        return out

    def validate(self) -> None:
        """Reject an impossible table, naming the tick, stage and micro-batch."""
        K, M = self.stages, self.microbatches
        bad = (self.ops != IDLE) & ((self.mb < 0) | (self.mb >= M))
        if bad.any():
            t, k = np.argwhere(bad)[0]
            raise ScheduleError(f"schedule {self.name!r}: tick {t}, stage {k} names micro-batch "
                                f"{self.mb[t, k]} outside 0..{M - 1}")
        for op in (FWD, BWD):
            for k in range(K):
                seen = self.mb[self.ops[:, k] == op, k]
                counts = np.bincount(seen, minlength=M)
                if (counts != 1).any():
                    m = int(np.argmax(counts != 1))
                    raise ScheduleError(
                        f"schedule {self.name!r}: stage {k} runs {_OP_LETTER[op]} of micro-batch {m} "
                        f"{counts[m]} times; every micro-batch needs exactly one forward and one "
                        "backward on every stage")
        F, B = self.tick_of(FWD), self.tick_of(BWD)
        for k in range(1, K):
            for m in range(M):
                if F[k, m] <= F[k - 1, m]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: tick {F[k, m]}, stage {k} runs the forward of "
                        f"micro-batch {m} before its input exists (stage {k - 1} sends it at "
                        f"tick {F[k - 1, m]})")
        for k in range(K):
            for m in range(M):
                if B[k, m] <= F[k, m]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: tick {B[k, m]}, stage {k} runs the backward of "
                        f"micro-batch {m} before its forward (tick {F[k, m]})")
                if k < K - 1 and B[k, m] <= B[k + 1, m]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: tick {B[k, m]}, stage {k} runs the backward of "
                        f"micro-batch {m} before stage {k + 1} sends its gradient (tick {B[k + 1, m]})")

    @property
    def bubble_fraction(self) -> float:
        """Share of (tick, stage) cells that are idle."""
        return float(np.mean(self.ops == IDLE))

    @property
    def input_capacity(self) -> int:
        """Ring-buffer slots for stage inputs: alive from arrival to backward."""
        F, B = self.tick_of(FWD), self.tick_of(BWD)
        return _ring_capacity([list(zip(F[k - 1], B[k])) for k in range(1, self.stages)],
                              self.microbatches)

    @property
    def grad_capacity(self) -> int:
        """Ring-buffer slots for received output gradients: arrival to backward."""
        B = self.tick_of(BWD)
        return _ring_capacity([list(zip(B[k + 1], B[k])) for k in range(self.stages - 1)],
                              self.microbatches)

    @property
    def residual_capacity(self) -> int:
        """Ring-buffer slots for kept residuals: forward to backward on one stage."""
        F, B = self.tick_of(FWD), self.tick_of(BWD)
        return _ring_capacity([list(zip(F[k], B[k])) for k in range(self.stages)],
                              self.microbatches)

    @property
    def delays(self) -> list[int]:
        """Per stage: weight updates between a micro-batch's forward and backward."""
        if self.synchronous:
            return [0] * self.stages
        F, B = self.tick_of(FWD), self.tick_of(BWD)
        return [int(np.max([np.sum((B[k] > F[k, m]) & (B[k] < B[k, m])) for m in range(self.microbatches)]))
                for k in range(self.stages)]

    def stage_info(self, k: int) -> StageInfo:
        D = self.delays[k]
        return StageInfo(stage=k, stages=self.stages, delay=D, forward_horizon=D, backward_horizon=0)

    def render(self, width: int = 4) -> str:
        """Text Gantt chart: one row per stage, one column per tick."""
        head = "tick    " + "".join(str(t).rjust(width) for t in range(self.ticks))
        rows = [head]
        for k in range(self.stages):
            cells = []
            for t in range(self.ticks):
                op = int(self.ops[t, k])
                cells.append((_OP_LETTER[op] + (str(self.mb[t, k]) if op != IDLE else "")).rjust(width))
            rows.append(f"stage {k} " + "".join(cells))
        rows.append(f"{self.name}: K={self.stages} M={self.microbatches} ticks={self.ticks} "
                    f"bubble={self.bubble_fraction:.3f}")
        return "\n".join(rows)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"ticks={self.ticks}, bubble_fraction={self.bubble_fraction:.3f})")
