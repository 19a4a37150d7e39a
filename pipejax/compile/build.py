"""A compiled pipeline's parts as one value: what every program is built from.

`Build` holds, side by side, the placement (which device holds each model
chunk), the stage code (the layers of every chunk as switch branches), the
schedule table, the buffer layout, the mesh and how a stage is laid out
over its devices (`StageLayout`: fsdp, tensor, where a sharded stage's
weights are gathered), and checks
that the code and the table were made for the same placement. Programs take `(build, opts)`;
a `Pipeline` holds one build, a `Trainer` one build and one `StageOptimizers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from pipejax.compile.layout import Layout
from pipejax.compile.stages import StageCode
from pipejax.errors import ConfigError
from pipejax.mesh import batch_axes, data_axes, replicas
from pipejax.placement import Placement
from pipejax.schedules import Schedule
from pipejax.stage_layout import StageLayout


@dataclasses.dataclass(frozen=True, eq=False)
class Build:
    """Placement, stage code, schedule, layout and mesh of one compiled pipeline."""

    placement: Placement
    code: StageCode
    schedule: Schedule
    layout: Layout
    mesh: Mesh
    stage: StageLayout  # a stage's fsdp and tensor devices, and where its pieces gather

    def __post_init__(self):
        for what, other in (("stage code", self.code.placement),
                            ("schedule", self.schedule.placement)):
            if other != self.placement:
                raise ConfigError(f"the {what} is made for {other!r} but the pipeline for "
                                  f"{self.placement!r}; build both from one pj.Placement")

    @property
    def K(self) -> int:
        """Pipeline stages (devices of the stage axis)."""
        return self.placement.stages

    @property
    def M(self) -> int:
        """Micro-batches per step (of each replica)."""
        return self.schedule.microbatches

    @property
    def R(self) -> int:
        """Pipeline replicas: the product of the mesh's data axes."""
        return replicas(self.mesh)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's data axes (the replicas'), () without any."""
        return data_axes(self.mesh)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes a batch is split over: the data axes, and `fsdp` when F > 1."""
        return batch_axes(self.mesh)

    @property
    def F(self) -> int:
        """The devices each stage is sharded over (the mesh's `fsdp` axis; 1 without)."""
        return self.stage.fsdp

    @property
    def rows(self) -> int:
        """R·K·F: the rows of a buffer with a row per device (`spmd.per_device`)."""
        return self.R * self.K * self.F

    @property
    def example(self) -> Any:
        """ShapeDtypeStructs of one micro-batch of inputs (one device's part
        of it, mb / F examples, on a stage sharded over F devices)."""
        return self.code.model.example

    @property
    def targets(self) -> Any:
        """ShapeDtypeStructs of one micro-batch of targets (one device's part)."""
        return self.code.model.targets
