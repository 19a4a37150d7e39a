"""A schedule is data: a `[ticks, stages]` table of which micro-batch each
stage runs forward and backward at each tick.

In the spirit of JaxPP's task lists, a `Schedule` can be printed, checked
and measured without running a model; the executor runs any valid table.
A cell has two lanes, a forward and a backward, each naming a micro-batch or
`NONE`; within a tick the forward runs first (pipelined backpropagation runs
both lanes every tick, the other schedules one). Micro-batch numbers are
relative to the step's first micro-batch.

A *synchronous* table runs micro-batches 0..M−1 from an empty pipeline to an
empty one and applies one update per step (GPipe, 1F1B). An *asynchronous*
table is one period of a pipeline that never drains (PipeDream, pipelined
backpropagation): step s runs it with micro-batch ids s·M + relative id
(negative ids are micro-batches fed by earlier steps), and each stage updates
its weights after every backward. Everything the executor needs to size its
buffers, and everything a staleness-aware optimizer needs (delays, SpecTrain
horizons), is derived here from the unrolled table, never written by hand.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.schedules import pictures
from pipejax.schedules.timeline import NONE, Timeline, ring_capacity, unroll

# Event times within a tick: the forward lane, then the backward lane (with its
# update), then the filing of the messages that arrived at the end of the tick.
_F, _B, _END = 1, 2, 3


class StageInfo(NamedTuple):
    """What a per-stage optimizer may depend on: its place and its staleness."""

    stage: int  # k, counted from 0
    stages: int  # K
    delay: int  # D: this stage's weight updates between a micro-batch's forward and backward
    forward_horizon: int  # this stage's updates from a forward to the end of that round trip
    backward_horizon: int  # the same from the backward


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """`fwd[t, k]`, `bwd[t, k]`: the micro-batch stage k runs forward / backward
    at tick t (relative to the step's first micro-batch), or `NONE`."""

    name: str
    fwd: np.ndarray
    bwd: np.ndarray
    microbatches: int
    asynchronous: bool = False

    def __post_init__(self):
        fwd, bwd = np.asarray(self.fwd, np.int64), np.asarray(self.bwd, np.int64)
        if fwd.ndim != 2 or fwd.shape != bwd.shape:
            raise ScheduleError(f"schedule {self.name!r}: fwd {fwd.shape} and bwd {bwd.shape} "
                                "must both be [ticks, stages]")
        object.__setattr__(self, "fwd", fwd)
        object.__setattr__(self, "bwd", bwd)
        object.__setattr__(self, "_timelines", {})  # steps -> Timeline
        self.validate()

    @property
    def ticks(self) -> int:
        return self.fwd.shape[0]

    @property
    def stages(self) -> int:
        return self.fwd.shape[1]

    @property
    def synchronous(self) -> bool:
        return not self.asynchronous

    # ------------------------------------------------------------- unrolling
    def timeline(self, steps: int = 1) -> Timeline:
        """Unroll `steps` steps; an asynchronous table then runs periods with no
        new input until every micro-batch fed has finished (the flush)."""
        if steps not in self._timelines:
            self._timelines[steps] = unroll(self.name, self.fwd, self.bwd, self.microbatches,
                                           self.asynchronous, steps)
        return self._timelines[steps]

    def validate(self) -> None:
        """Reject an impossible table, naming the tick, stage and micro-batch."""
        K, M, T = self.stages, self.microbatches, self.ticks
        where = lambda tick: f"tick {tick % T}" + (f" of step {tick // T}" if self.asynchronous else "")
        if not self.asynchronous:
            for lane in (self.fwd, self.bwd):
                bad = (lane != NONE) & ((lane < 0) | (lane >= M))
                if bad.any():
                    t, k = np.argwhere(bad)[0]
                    raise ScheduleError(f"schedule {self.name!r}: tick {t}, stage {k} names "
                                        f"micro-batch {lane[t, k]} outside 0..{M - 1}")
        tl = self.timeline(3 if self.asynchronous else 1)
        F, B = tl.F, tl.B
        for k in range(1, K):
            for g in range(F.shape[1]):
                if F[k, g] <= F[k - 1, g]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {where(F[k, g])}, stage {k} runs the forward of "
                        f"micro-batch {g} before its input exists (stage {k - 1} sends it at "
                        f"{where(F[k - 1, g])})")
        for k in range(K):
            for g in range(F.shape[1]):
                if B[k, g] < F[k, g]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {where(B[k, g])}, stage {k} runs the backward of "
                        f"micro-batch {g} before its forward ({where(F[k, g])})")
                if k < K - 1 and B[k, g] <= B[k + 1, g]:
                    raise ScheduleError(
                        f"schedule {self.name!r}: {where(B[k, g])}, stage {k} runs the backward of "
                        f"micro-batch {g} before stage {k + 1} sends its gradient "
                        f"({where(B[k + 1, g])})")

    # --------------------------------------------------------- derived facts
    def bubble_fraction_over(self, steps: int) -> float:
        """Idle share of the op slots (one per lane the table uses, per stage and
        tick) from the first op to the last, over `steps` steps and the flush."""
        lanes = 2 if ((self.fwd != NONE) & (self.bwd != NONE)).any() else 1
        tl = self.timeline(steps)
        busy = tl.F.size + tl.B.size
        return 1.0 - busy / (lanes * self.stages * tl.ticks)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the op slots over one step (and, if asynchronous, its flush)."""
        return self.bubble_fraction_over(1)

    @property
    def _steady_steps(self) -> int:
        """Steps to unroll so that the middle step sees the steady state: the
        longest life of a micro-batch spans at most 2·(K + ticks) ticks."""
        if self.synchronous:
            return 1
        return 3 + 2 * -(-2 * (self.stages + self.ticks) // self.ticks)

    def _steady(self) -> Timeline:
        return self.timeline(self._steady_steps)

    def _steady_ids(self) -> range:
        M, S = self.microbatches, self._steady_steps
        return range(M * (S // 2), M * (S // 2 + 1)) if self.asynchronous else range(M)

    def _live(self, write: np.ndarray, read: np.ndarray) -> int:
        """Ring-buffer capacity for values written at times `write[k, g]` and
        last read at `read[k, g]` (times in quarter ticks)."""
        return ring_capacity([list(zip(w.tolist(), r.tolist())) for w, r in zip(write, read)])

    @property
    def input_capacity(self) -> int:
        """Slots for stage inputs: filed when they arrive, read up to the backward."""
        tl = self._steady()
        return self._live(4 * tl.F[:-1] + _END, 4 * tl.B[1:] + _B)

    @property
    def grad_capacity(self) -> int:
        """Slots for received output gradients: arrival to the backward."""
        tl = self._steady()
        return self._live(4 * tl.B[1:] + _END, 4 * tl.B[:-1] + _B)

    @property
    def residual_capacity(self) -> int:
        """Slots for what a stage keeps from its forward to its backward
        (residuals, and with weight stashing the forward's weights)."""
        tl = self._steady()
        return self._live(4 * tl.F + _F, 4 * tl.B + _B)

    def in_flight(self, k: int) -> int:
        """Most micro-batches stage k holds at once between their forward and
        their backward: the inputs (and residuals) it stashes."""
        tl = self._steady()
        F, B = tl.F[k], tl.B[k]
        return int(max(np.sum((F <= t) & (t <= B)) for t in F))

    @property
    def data_capacity(self) -> int:
        """Slots for micro-batches of input and targets, a multiple of M: fed
        before their step starts, read up to the first and last stages' backward."""
        tl = self._steady()
        read = np.maximum(4 * tl.B[0] + _B, 4 * tl.B[-1] + _B)
        C = self._live((4 * tl.fed - 1)[None], read[None])
        return -(-C // self.microbatches) * self.microbatches

    @property
    def drain_periods(self) -> int:
        """Periods with no new input after a step until every micro-batch it
        fed has finished: what a flush runs (0 when synchronous)."""
        if self.synchronous:
            return 0
        last = int(self.timeline(1).B.max())  # global tick, step 0 starts at tick 0
        return -(-(last + 1) // self.ticks) - 1

    def _updates_between(self, k: int, g: int, start: float, stop: float) -> int:
        """Stage k's weight updates at times in (start, stop] (quarter ticks)."""
        when = 4 * self._steady().B[k] + _B
        return int(np.sum((when > start) & (when <= stop)))

    @property
    def delays(self) -> list[int]:
        """Per stage, D: weight updates of that stage between a micro-batch's
        forward and its backward there (steady state; 0 when synchronous)."""
        if self.synchronous:
            return [0] * self.stages
        tl = self._steady()
        return [max(self._updates_between(k, g, 4 * tl.F[k, g] + _F, 4 * tl.B[k, g] + _B - 1)
                    for g in self._steady_ids()) for k in range(self.stages)]

    def horizons(self, k: int) -> tuple[int, int]:
        """SpecTrain's version differences s for stage k (Chen et al. 2018, §3.2,
        eqs 5–6): the updates of stage k by other micro-batches from the
        forward (resp. backward) of a micro-batch on stage k until its round
        trip ends (its backward on stage 0). For `pipedream` they equal
        ⌊k/2⌋ + K − k − 1 and ⌊k/2⌋."""
        if self.synchronous:
            return 0, 0
        tl = self._steady()
        end = lambda g: 4 * tl.B[0, g] + _B
        # From the forward, the micro-batch's own update on stage k is not counted.
        fwd = max(self._updates_between(k, g, 4 * tl.F[k, g] + _F, end(g)) - 1
                  for g in self._steady_ids())
        bwd = max(self._updates_between(k, g, 4 * tl.B[k, g] + _B, end(g)) for g in self._steady_ids())
        return fwd, bwd

    def stage_info(self, k: int) -> StageInfo:
        f, b = self.horizons(k)
        return StageInfo(stage=k, stages=self.stages, delay=self.delays[k],
                         forward_horizon=f, backward_horizon=b)

    # ------------------------------------------------------------- pictures
    def render(self) -> str:
        """Text Gantt chart: one row per stage, one column per tick."""
        return pictures.render(self)

    def plot(self, path: str) -> None:
        """PNG timeline: forward, backward and idle cells coloured, micro-batch
        numbers in the cells."""
        pictures.plot(self, path)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"ticks={self.ticks}, asynchronous={self.asynchronous})")
