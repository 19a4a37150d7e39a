"""A compiled pipeline's parts as one value: what every program is built from.

`Build` gathers the stage code (the layers of every stage as switch
branches), the schedule table, the buffer layout and the mesh, and derives
what the programs read off them: K, M, the replica count R (its one source),
the data axes, one micro-batch's example and targets. Programs take
`(build, opts)`; a `Pipeline` holds one build, a `Trainer` one build and
one `StageOptimizers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from pipejax.compile.layout import Layout
from pipejax.compile.stages import StageCode
from pipejax.mesh import data_axes, replicas
from pipejax.schedules import Schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Build:
    """Stage code, schedule, layout and mesh of one compiled pipeline."""

    schedule: Schedule
    layout: Layout
    mesh: Mesh

    @property
    def code(self) -> StageCode:
        return self.layout.code

    @property
    def K(self) -> int:
        """Pipeline stages."""
        return self.schedule.stages

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
    def example(self) -> Any:
        """ShapeDtypeStructs of one micro-batch of inputs."""
        return self.code.model.example

    @property
    def targets(self) -> Any:
        """ShapeDtypeStructs of one micro-batch of targets."""
        return self.code.model.targets
