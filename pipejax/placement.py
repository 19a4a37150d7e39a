"""Where each model chunk lives: the one value for the stage layout.

The layer list is split into S = K·v contiguous chunks, the virtual stages
j = 0 … S − 1 in model order; each of the K devices holds v of them, its
local chunks c = 0 … v − 1. A `Placement` is made once by `pj.pipeline`
and handed to both the schedule builder and the partitioner; every map
between a chunk j and its (device k, local chunk c) is written here and
nowhere else. Two kinds:

- "loop", circular (Narayanan et al. 2021, §2.2): device k holds chunks
  k, k + K, …, so j = c·K + k, and a micro-batch goes round the ring of
  devices v times.
- "v" (Qi et al. 2024, §6, ZB-V; DeepSeek's DualPipeV): the chunks go down
  the devices and back up, device k holding chunks k and 2K − 1 − k (for
  v > 2 the zigzag goes on: local chunk c of device k is c·K + k for even
  c, c·K + K − 1 − k for odd c). The first and last chunks share device
  0, and chunk K − 1 hands its output to chunk K on its own device.

docs/design.md follows `virtual` from `pj.pipeline` to the compiled step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import numpy as np

from pipejax.errors import ConfigError


KINDS = ("loop", "v")


class Route(NamedTuple):
    """Messages between chunks whose devices are `shift` apart (mod K)."""

    shift: int
    pairs: list[tuple[int, int]]  # (source, destination) devices


@dataclasses.dataclass(frozen=True)
class Placement:
    """K devices holding v chunks each, placed as `kind` says ("loop":
    chunk j = c·K + k on device k; "v": down the devices and back up)."""

    stages: int  # K
    virtual: int = 1  # v
    kind: Literal["loop", "v"] = "loop"

    def __post_init__(self):
        if not isinstance(self.stages, (int, np.integer)) or self.stages < 1:
            raise ConfigError(f"stages={self.stages!r}; a pipeline needs at least 1 stage")
        if not isinstance(self.virtual, (int, np.integer)) or self.virtual < 1:
            raise ConfigError(f"virtual={self.virtual!r}; give the model chunks per device, "
                              "1 or more")
        if self.kind not in KINDS:
            raise ConfigError(f"placement={self.kind!r}; use one of {list(KINDS)}: 'loop' puts "
                              "chunks k, k + K, ... on device k, 'v' chunks k and 2K − 1 − k")
        if self.kind == "v" and self.virtual < 2:
            raise ConfigError(f"placement='v' with virtual={self.virtual}: a V places two or "
                              "more chunks per device; give virtual=2 (or placement='loop')")
        object.__setattr__(self, "stages", int(self.stages))
        object.__setattr__(self, "virtual", int(self.virtual))

    @property
    def chunks(self) -> int:
        """S = K·v: the virtual stages (the stages when v = 1)."""
        return self.stages * self.virtual

    def _mirror(self, c: Any, r: Any) -> Any:
        """Position r along the devices on pass c: r going down (loop, or an
        even pass of a V), K − 1 − r going back up (an odd pass of a V).
        Arithmetic only, so that ints, numpy and traced arrays all work."""
        if self.kind == "loop":
            return r
        return r + (c % 2) * (self.stages - 1 - 2 * r)

    def device(self, j: Any) -> Any:
        """The device k that holds chunk j (ints or arrays)."""
        return self._mirror(j // self.stages, j % self.stages)

    def local(self, j: Any) -> Any:
        """Chunk j's place c among its device's chunks (ints or arrays)."""
        return j // self.stages

    def chunk(self, k: Any, c: Any) -> Any:
        """The chunk j held by device k as its local chunk c (ints or arrays)."""
        return c * self.stages + self._mirror(c, k)

    def ring(self, g: Any, c: Any) -> Any:
        """The ring id of micro-batch g on local chunk c: its slot in a
        device's ring buffers is this id mod the ring's capacity."""
        return g * self.virtual + c

    def device_chunks(self, k: int) -> list[int]:
        """Device k's chunks, in its local order c = 0 … v − 1."""
        return [self.chunk(k, c) for c in range(self.virtual)]

    def next_local(self, j: Any, k: Any) -> Any:
        """The local chunk of chunk j + 1 on its device, from the sender's
        chunk j and device k (traced values): where the receiver files it."""
        if self.kind == "loop":
            return j // self.stages + (k == self.stages - 1)
        return (j + 1) // self.stages

    def previous_local(self, j: Any, k: Any) -> Any:
        """The local chunk of chunk j − 1 on its device, from the sender's
        chunk j and device k: where a gradient sent back is filed."""
        if self.kind == "loop":
            return j // self.stages - (k == 0)
        return (j - 1) // self.stages

    def shift(self, j: Any, step: int) -> Any:
        """How many devices on (mod K) chunk j + `step` sits from chunk j:
        the route a message between them takes (ints or arrays)."""
        return (self.device(j + step) - self.device(j)) % self.stages

    def routes(self, step: int) -> list[Route]:
        """The ways messages from chunk j to chunk j + `step` (1: activations
        on, −1: gradients back) travel, one per device shift: each a set of
        (source, destination) pairs that `lax.ppermute` can run at once
        (shift 0: the message stays on its device). The loop has one route,
        the ring; a V three (down, the turn, up), at K = 2 two."""
        by = {}
        for j in range(max(0, -step), self.chunks - max(0, step)):
            by.setdefault(self.shift(j, step), set()).add((self.device(j), self.device(j + step)))
        return [Route(shift, sorted(pairs)) for shift, pairs in sorted(by.items())]

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
        if self.kind == "v":
            return (f"{self.virtual} chunks per device, device k holds chunks k, "
                    f"{2 * self.stages - 1} − k, ... (V placement)")
        return (f"{self.virtual} chunks per device, device k holds chunks k, k + {self.stages}, "
                "... (circular placement)")
