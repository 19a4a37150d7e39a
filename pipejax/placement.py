"""Where each model chunk lives: the one value for the stage layout.

The layer list is split into S = K·v contiguous chunks, the virtual stages
j = 0 … S − 1 in model order; each of the K devices holds v of them, its
local chunks c = 0 … v − 1. A `Placement` is made once by `pj.pipeline`
and handed to both the schedule builder and the partitioner; every map
between a chunk j and its (device k, local chunk c) is written here and
nowhere else. The placement is circular (Narayanan et al. 2021, §2.2):
device k holds chunks k, k + K, …, so j = c·K + k, and a micro-batch goes
round the ring of devices v times. docs/design.md follows `virtual` from
`pj.pipeline` to the compiled step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Placement:
    """K devices holding v chunks each, chunk j = c·K + k on device k."""

    stages: int  # K
    virtual: int = 1  # v

    def __post_init__(self):
        if not isinstance(self.stages, (int, np.integer)) or self.stages < 1:
            raise ConfigError(f"stages={self.stages!r}; a pipeline needs at least 1 stage")
        if not isinstance(self.virtual, (int, np.integer)) or self.virtual < 1:
            raise ConfigError(f"virtual={self.virtual!r}; give the model chunks per device, "
                              "1 or more")
        object.__setattr__(self, "stages", int(self.stages))
        object.__setattr__(self, "virtual", int(self.virtual))

    @property
    def chunks(self) -> int:
        """S = K·v: the virtual stages (the stages when v = 1)."""
        return self.stages * self.virtual

    def device(self, j: Any) -> Any:
        """The device k that holds chunk j (ints or arrays)."""
        return j % self.stages

    def local(self, j: Any) -> Any:
        """Chunk j's place c among its device's chunks (ints or arrays)."""
        return j // self.stages

    def chunk(self, k: Any, c: Any) -> Any:
        """The chunk j held by device k as its local chunk c (ints or arrays)."""
        return c * self.stages + k

    def ring(self, g: Any, c: Any) -> Any:
        """The ring id of micro-batch g on local chunk c: its slot in a
        device's ring buffers is this id mod the ring's capacity."""
        return g * self.virtual + c

    def device_chunks(self, k: int) -> range:
        """Device k's chunks, in its local order c = 0 … v − 1."""
        return range(k, self.chunks, self.stages)

    def next_local(self, j: Any, k: Any) -> Any:
        """The local chunk of chunk j + 1 on its device, from the sender's
        chunk j and device k (traced values): where the receiver files it."""
        return j // self.stages + (k == self.stages - 1)

    def previous_local(self, j: Any, k: Any) -> Any:
        """The local chunk of chunk j − 1 on its device, from the sender's
        chunk j and device k: where a gradient sent back is filed."""
        return j // self.stages - (k == 0)

    def forward_pairs(self) -> list[tuple[int, int]]:
        """(source, destination) devices of the messages from chunk j to j + 1
        (the ring closes when a micro-batch goes round more than once)."""
        K = self.stages
        return [(i, i + 1) for i in range(K - 1)] + ([(K - 1, 0)] if self.virtual > 1 else [])

    def per_device(self, a: np.ndarray) -> np.ndarray:
        """`[S, N]` rows per chunk -> `[K, N·v]` rows per device, column
        g·v + c for micro-batch g on local chunk c (the device's ring ids)."""
        index = np.array([list(self.device_chunks(k)) for k in range(self.stages)])
        return a[index].transpose(0, 2, 1).reshape(self.stages, -1)

    def name(self, j: int) -> str:
        """Chunk j as an error message names it."""
        if self.virtual == 1:
            return f"stage {j}"
        return f"virtual stage {j} (device {self.device(j)}, chunk {self.local(j)})"

    def __str__(self) -> str:
        if self.virtual == 1:
            return f"{self.stages} stages, one per device"
        return (f"{self.virtual} chunks per device, device k holds chunks k, k + {self.stages}, "
                "... (circular placement)")
