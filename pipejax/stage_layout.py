"""How one stage is laid out over its devices: F devices of the `fsdp` axis
hold a piece each (ZeRO-3), T devices of the `tensor` axis split each
annotated parameter (Megatron), and where a sharded stage gathers its
weights whole (`Gather`; compile/fsdp.py). Built once per pipeline from its
mesh and `pj.pipeline(..., fsdp_gather=)`; the executor, the memory
estimate, the planner and the CLI read it."""

from __future__ import annotations

import dataclasses
import enum

from jax.sharding import Mesh

from pipejax.errors import ConfigError
from pipejax.mesh import fsdp_degree, tensor_degree
from pipejax.schedules import Schedule


class Gather(enum.Enum):
    """Where a stage sharded over `fsdp` gathers its weights.

    TICK: at every tick whose ops use them, each weight gradient scattered
      to the pieces in its op's loop (the least memory; any table).
    STEP: once a step before the table's scan, the gradient sum scattered
      once after it (one gather a step; synchronous tables: an asynchronous
      one updates the weights at every backward). Measured in compile/fsdp.py.
    """

    TICK = "tick"
    STEP = "step"


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """A stage's devices: F pieces, T tensor parts, where the pieces gather."""

    fsdp: int = 1  # F
    tensor: int = 1  # T
    gather: Gather = Gather.TICK

    @classmethod
    def of(cls, mesh: Mesh, gather: Gather | str | None, schedule: Schedule) -> StageLayout:
        """The layout `mesh` gives a stage, gathering where `gather` says
        (None: `Gather.TICK`); raises where `schedule` cannot gather there."""
        try:
            where = Gather(gather or Gather.TICK)
        except ValueError:
            raise ConfigError(f"fsdp_gather={gather!r}; use 'tick' (gather a sharded stage's "
                              "weights at each tick that uses them), 'step' (once per step) or "
                              "None") from None
        if where is Gather.STEP and schedule.asynchronous:
            raise ConfigError(f"fsdp_gather='step' gathers the weights once per step, but "
                              f"{schedule.name!r} updates them after every backward; use 'tick'")
        return cls(fsdp_degree(mesh), tensor_degree(mesh), where)

    @property
    def sharded(self) -> bool:
        """Whether each device holds a piece of the stage (F > 1)."""
        return self.fsdp > 1

    @property
    def gathers_once(self) -> bool:
        """Whether the stage's weights are gathered once a step (sharded, `Gather.STEP`)."""
        return self.sharded and self.gather is Gather.STEP
