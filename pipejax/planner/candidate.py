"""A configuration `pj.search` ranked, what it is predicted to cost, and the ranking as a table."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from pipejax.formatting import human_bytes, table
from pipejax.mesh import make_mesh


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and what it is predicted to cost."""

    schedule: str
    stages: int  # K
    data: int  # replicas
    fsdp: int  # F, the devices each stage is sharded over
    tensor: int  # T, the devices each annotated parameter is split over
    virtual: int  # v, chunks per device
    microbatches: int  # M per replica and step
    microbatch: int  # examples per micro-batch
    remat: str
    compute_dtype: str
    step_seconds: float  # predicted, one step of the whole batch
    memory_bytes: int  # predicted peak per device
    bubble: float  # idle share of the table's op slots
    effective_delay: float | None  # η/(1 − m)·D, largest stage; 0 synchronous; None unknown
    stable: bool | None  # effective_delay ≤ STABLE_DELAY (with LWP_D + SC_D); None: unknown
    advice: str

    def pipeline_args(self) -> dict[str, Any]:
        """The `pj.pipeline` arguments that build this candidate (but layers,
        loss, example and targets); with data replicas, their mesh."""
        return dict(stages=self.stages, microbatches=self.microbatches, schedule=self.schedule,
                    virtual=self.virtual, remat=self.remat,
                    compute_dtype=None if self.compute_dtype == "float32" else self.compute_dtype,
                    mesh=(make_mesh(self.stages, self.data, fsdp=self.fsdp, tensor=self.tensor)
                          if self.data * self.fsdp * self.tensor > 1 else None))


def render(candidates: Sequence[Candidate], limit: int = 20) -> str:
    """The ranked candidates as a table."""
    rows = [["#", "schedule", "K x R x F x T", "v", "M x mb", "remat", "dtype", "step", "memory",
             "bubble", "delay", "advice"]]
    for i, c in enumerate(candidates[:limit]):
        delay = "?" if c.effective_delay is None else f"{c.effective_delay:.3g}"
        rows.append([str(i), c.schedule, f"{c.stages} x {c.data} x {c.fsdp} x {c.tensor}",
                     str(c.virtual),
                     f"{c.microbatches} x {c.microbatch}", c.remat, c.compute_dtype,
                     f"{c.step_seconds * 1e3:.3g} ms", human_bytes(c.memory_bytes),
                     f"{c.bubble:.2f}", delay, c.advice])
    return table(rows)
