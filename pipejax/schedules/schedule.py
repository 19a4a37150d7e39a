"""A schedule is data: a `[ticks, stages, lanes]` table of typed tasks.

In the spirit of JaxPP's task lists, a `Schedule` can be printed, checked
and measured without running a model; the executor runs any valid table.
Each cell holds a `Task(op, micro-batch, chunk)` per lane (tasks.py); within
a tick the lanes run in order (pipelined backpropagation runs a forward and
a backward every tick, the other schedules one op). Micro-batch numbers are
relative to the step's first micro-batch.

A *synchronous* table runs micro-batches 0..M−1 from an empty pipeline to an
empty one and applies one update per step (GPipe, 1F1B). An *asynchronous*
table is one period of a pipeline that never drains (PipeDream, pipelined
backpropagation): step s runs it with micro-batch ids s·M + relative id
(negative ids are micro-batches fed by earlier steps), and each stage updates
its weights after every backward, or, `double_buffered` (PipeDream-2BW),
once a step with the step's accumulated gradient, every op of step j on
the version W(j − 1) (versions.py).

A `Schedule` owns its table, the table's accessors and validation, its
unrolled timelines (`timeline`, the `steady` state, `lifetime`) and the
staleness facts a per-stage optimizer reads (delays, SpecTrain horizons,
`stage_info`), all derived from the unrolled table, never written by hand.
What else is read off a schedule lives beside it as functions of one:
ring capacities (capacities.py), bubbles (bubbles.py), pictures (pictures.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.placement import Placement
from pipejax.schedules import torch_csv
from pipejax.schedules.checks import check_order, check_tasks, check_versions
from pipejax.schedules.tasks import BACKWARD, NONE, Op
from pipejax.schedules.timeline import Timeline, lifetime, unroll


class StageInfo(NamedTuple):
    """What a per-stage optimizer may depend on: its place and its staleness."""

    stage: int  # k, counted from 0
    stages: int  # K
    delay: int  # D: this stage's weight updates between a micro-batch's forward and backward
    forward_horizon: int  # this stage's updates from a forward to the end of that round trip
    backward_horizon: int  # the same from the backward


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """`table[t, k, lane]` = (op, micro-batch, chunk): the `Task` stage k runs
    in that lane at tick t (tasks.py; build one with `tasks.empty` and
    `tasks.put`, or `tasks.from_lanes`); the chunk is device k's local
    chunk c, which `placement` maps to a virtual stage (default: one chunk
    per device)."""

    name: str
    table: np.ndarray
    microbatches: int
    asynchronous: bool = False
    placement: Placement | None = None
    double_buffered: bool = False  # asynchronous, one update a step, one step behind

    def __post_init__(self):
        table = np.asarray(self.table, np.int64)
        if table.ndim != 4 or table.shape[-1] != 3 or 0 in table.shape:
            raise ScheduleError(f"schedule {self.name!r}: table {table.shape} must be [ticks, "
                                "stages, lanes, (op, micro-batch, chunk)]")
        object.__setattr__(self, "table", table)
        if self.placement is None:
            object.__setattr__(self, "placement", Placement(table.shape[1]))
        object.__setattr__(self, "_timelines", {})  # steps -> Timeline
        check_tasks(self.name, table, self.placement, self.asynchronous)
        if self.double_buffered and not self.asynchronous:
            raise ScheduleError(f"schedule {self.name!r}: double_buffered needs an asynchronous "
                                "table (a synchronous one updates once a step with no delay)")
        self.validate()

    @property
    def ticks(self) -> int:
        return self.table.shape[0]

    @property
    def stages(self) -> int:
        return self.table.shape[1]

    @property
    def lanes(self) -> int:
        return self.table.shape[2]

    @property
    def ops(self) -> np.ndarray:
        """`[ticks, stages, lanes]` op codes (`Op`)."""
        return self.table[..., 0]

    def lane_ops(self, lane: int) -> tuple[Op, ...]:
        """The ops that occur in `lane`, idle left out: what the executor compiles there."""
        return tuple(Op(o) for o in np.unique(self.ops[:, :, lane]) if o != Op.IDLE)

    def cells(self, ops: tuple[Op, ...], field: int = 1) -> np.ndarray:
        """`[ticks, stages]`: the micro-batch (`field` 1) or chunk (2) of the
        cell's task among `ops`, or NONE."""
        mask = np.isin(self.ops, ops)
        return np.where(mask, self.table[..., field], NONE).max(axis=2, initial=NONE)

    @property
    def fwd(self) -> np.ndarray:
        """`[ticks, stages]`: the micro-batch stage k runs forward at tick t, or NONE."""
        return self.cells((Op.F,))

    @property
    def bwd(self) -> np.ndarray:
        """`[ticks, stages]`: the micro-batch whose gradient stage k sends back at tick t."""
        return self.cells(BACKWARD)

    @property
    def fused(self) -> np.ndarray:
        """`[ticks, stages]`: where a stage runs the forward and then the fused
        backward (BW) of one micro-batch on one chunk in one tick (only the
        last virtual stage can: the others wait for a gradient). The
        executor runs the pair as one vjp and keeps no residuals (at K = 1,
        the plain micro-batched step)."""
        f, c = self.fwd, self.cells((Op.F,), 2)
        return (f != NONE) & (f == self.cells((Op.BW,))) & (c == self.cells((Op.BW,), 2))

    @property
    def messages(self) -> int:
        """The message buffers a device's ops write at one tick: 1 where no
        device runs a forward and a backward (B or BW) at the same tick
        (every family at K > 1 but PB and DualPipeV's pairs; at K = 1 the
        fused pairs, which send nothing), else 2. An op writes its message
        whether it goes anywhere or not (the last chunk's forward, the
        first chunk's backward), so two ops of one tick never share a
        buffer. The executor carries that many (table.py); one
        buffer goes along each route once, where a V's two go down and up
        together (a message takes the route of its chunk)."""
        return 2 if ((self.fwd != NONE) & (self.bwd != NONE)).any() else 1

    @property
    def synchronous(self) -> bool:
        return not self.asynchronous

    @property
    def consistent(self) -> bool:
        """Whether a backward runs on the weights its forward ran on without
        weight stashing (synchronous, double-buffered): residuals kept at
        the forward are then the backward's own."""
        return self.synchronous or self.double_buffered

    @property
    def updates_per_step(self) -> int:
        """A stage's weight updates a step: M where every backward updates
        (PipeDream, PB), 1 where a step's gradients make one (synchronous,
        double-buffered)."""
        return self.microbatches if self.asynchronous and not self.double_buffered else 1

    # ------------------------------------------------------------ torch's CSV
    @classmethod
    def from_csv(cls, source: str | os.PathLike, microbatches: int, format: str = "torch",
                 name: str | None = None) -> Schedule:
        """The table of a schedule written by torch.distributed.pipelining
        (`_dump_csv`, "compute_only": a row per rank; a path or its text),
        for `microbatches` micro-batches. Each rank's actions keep their
        order; each runs at the earliest tick after what it needs (torch_csv.py).
        The ranks' stages give the placement (loop or V) and `virtual`."""
        _format(format)
        if name is None:
            path = torch_csv.is_path(source)
            name = os.path.splitext(os.path.basename(source))[0] if path else "csv"
        table, placement = torch_csv.read(source, microbatches, name)
        return cls(name, table, microbatches, placement=placement)

    def to_csv(self, path: str | os.PathLike | None = None, format: str = "torch") -> str:
        """This table in torch's CSV ("compute_only": a row per rank, a slot
        per tick, global stage ids), written to `path` if given; returns the text."""
        _format(format)
        if self.asynchronous:
            raise ScheduleError(f"schedule {self.name!r} is asynchronous: torch's format holds "
                                "a synchronous step, from an empty pipeline to an empty one")
        text = torch_csv.write(self.table, self.placement)
        if path is not None:
            with open(path, "w", newline="") as f:
                f.write(text)
        return text

    # ------------------------------------------------------------- unrolling
    def timeline(self, steps: int = 1) -> Timeline:
        """Unroll `steps` steps; an asynchronous table then runs periods with no
        new input until every micro-batch fed has finished (the flush)."""
        if steps not in self._timelines:
            self._timelines[steps] = unroll(self.name, self.table, self.placement,
                                           self.microbatches, self.asynchronous, steps)
        return self._timelines[steps]

    def validate(self) -> None:
        """Reject an impossible table, naming the tick, stage and micro-batch
        (checks.py)."""
        check_order(self.name, self.table, self.microbatches, self.asynchronous,
                    self.timeline(3 if self.asynchronous else 1))
        if self.double_buffered:
            check_versions(self.name, self.timeline(4), self.microbatches)

    # --------------------------------------------------------- derived facts
    @property
    def lifetime(self) -> int:
        """Periods a micro-batch stays in flight after the step that feeds it
        (`timeline.lifetime`; 0 when synchronous)."""
        return lifetime(self.table[..., 1], self.microbatches) if self.asynchronous else 0

    def steady(self) -> Timeline:
        """The timeline of 2·lifetime + 1 steps, whose middle step sees the
        steady state: a lifetime of steps before it and after it (one step
        when synchronous)."""
        return self.timeline(2 * self.lifetime + 1)

    def _steady_ids(self) -> range:
        """The micro-batches of `steady`'s middle step."""
        M, L = self.microbatches, self.lifetime
        return range(M * L, M * (L + 1))

    @property
    def drain_periods(self) -> int:
        """Periods with no new input after a step until every micro-batch it
        fed has finished: what a flush runs (0 when synchronous)."""
        return self.lifetime

    def _updates_between(self, k: int, start: float, stop: float) -> int:
        """Stage k's weight updates at event times in (start, stop]."""
        when = self.steady().b_time[k]
        return int(np.sum((when > start) & (when <= stop)))

    @property
    def delays(self) -> list[int]:
        """Per stage, D: weight updates of that stage between a micro-batch's
        forward and its backward there (steady state; 0 when synchronous),
        or, `double_buffered`, the updates its gradient is behind: 1."""
        if self.synchronous or self.double_buffered:
            return [int(self.double_buffered)] * self.stages
        tl = self.steady()
        return [max(self._updates_between(k, tl.f_time[k, g], tl.b_time[k, g] - 1)
                    for g in self._steady_ids()) for k in range(self.stages)]

    def horizons(self, k: int) -> tuple[int, int]:
        """SpecTrain's version differences s for stage k (Chen et al. 2018, §3.2,
        eqs 5–6): the updates of stage k by other micro-batches from the
        forward (resp. backward) of a micro-batch on stage k until its round
        trip ends (its backward on stage 0). For `pipedream` they equal
        ⌊k/2⌋ + K − k − 1 and ⌊k/2⌋. Double-buffered tables have none: no
        update comes between a step's ops, which run on one version."""
        if self.synchronous or self.double_buffered:
            return 0, 0
        tl = self.steady()
        end = lambda g: tl.b_time[0, g]
        # From the forward, the micro-batch's own update on stage k is not counted.
        fwd = max(self._updates_between(k, tl.f_time[k, g], end(g)) - 1
                  for g in self._steady_ids())
        bwd = max(self._updates_between(k, tl.b_time[k, g], end(g)) for g in self._steady_ids())
        return fwd, bwd

    def stage_info(self, k: int) -> StageInfo:
        f, b = self.horizons(k)
        return StageInfo(stage=k, stages=self.stages, delay=self.delays[k],
                         forward_horizon=f, backward_horizon=b)

    def __repr__(self) -> str:
        v, kind = self.placement.virtual, self.placement.kind
        virtual = f", virtual={v}" + (f", placement={kind!r}" if kind != "loop" else "") \
            if v > 1 else ""
        double = ", double_buffered=True" if self.double_buffered else ""
        return (f"Schedule({self.name!r}, stages={self.stages}{virtual}, "
                f"microbatches={self.microbatches}, ticks={self.ticks}, "
                f"asynchronous={self.asynchronous}{double})")


def _format(format: str) -> None:
    if format != "torch":
        raise ScheduleError(f"format={format!r}; pipejax reads and writes torch's compute_only "
                            "CSV, format='torch'")
