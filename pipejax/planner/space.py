"""What `pj.search` tries (`Space`) and what it trains (`Training`)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple, Sequence

import optax

from pipejax.checks import REMATS
from pipejax.errors import ConfigError
from pipejax.schedules import FAMILIES, names


class Try(NamedTuple):
    """One configuration to build: K stages of F × T devices, R replicas,
    M micro-batches, a schedule, a remat mode and a compute dtype."""

    stages: int
    fsdp: int
    tensor: int
    replicas: int
    microbatches: int
    schedule: str
    remat: str
    compute_dtype: Any


@dataclasses.dataclass(frozen=True)
class Training:
    """The step a candidate runs.

    Attributes:
      batch: examples per step, over all replicas.
      optimizer: whose state the memory counts (default SGD with momentum).
      learning_rate, momentum: the asynchronous update's own rate and
        momentum, or reference=(η, m, B): a synchronous recipe at batch B
        moved to the micro-batch by eq. 9 (Kosson et al. 2020).
    """

    batch: int
    optimizer: optax.GradientTransformation | None = None
    learning_rate: float | None = None
    momentum: float = 0.0
    reference: tuple[float, float, int] | None = None

    def __post_init__(self):
        if self.batch < 1:
            raise ConfigError(f"Training(batch={self.batch}): must be positive")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Space:
    """The settings `pj.search` tries, each a sequence of choices.

    Attributes:
      schedules: family names (default: the families marked `searched`),
        each built with its family's `search_virtual` chunks per device.
      stages: the K to try (default: every divisor of N up to the number of
        layers).
      fsdp: the F to try, devices each stage is sharded over.
      tensor: the T to try, devices each annotated parameter is split over
        (a T the annotations do not take is left out).
      microbatches: the M to try (default: K·2^i dividing a replica's
        batch, up to 4 of them).
      remat, compute_dtypes: the settings to try.
      partition: as `pj.pipeline` takes it, for every candidate.
    """

    schedules: Sequence[str] | None = None
    stages: Sequence[int] | None = None
    fsdp: Sequence[int] = (1,)
    tensor: Sequence[int] = (1,)
    microbatches: Sequence[int] | None = None
    remat: Sequence[str] = ("stage", "none")
    compute_dtypes: Sequence[Any] = (None,)
    partition: str | Sequence[int] = "variance"

    def __post_init__(self):
        given = list(self.schedules or [])
        unknown = [n for n in given if n not in FAMILIES]
        if unknown or not set(self.remat) <= set(REMATS):
            raise ConfigError(f"search over schedules {unknown or given}, remat "
                              f"{list(self.remat)}: use schedules from {', '.join(names())} and "
                              f"remat 'stage' or 'none'")

    def layouts(self, devices: int, layers: int) -> list[tuple[int, int, int]]:
        """The (K, F, T) that divide `devices`; raises where a K given fits none."""
        Ks = list(self.stages or [k for k in _divisors(devices) if k <= layers])
        out = [(K, F, T) for K in Ks for F in self.fsdp for T in self.tensor
               if devices % (K * F * T) == 0]
        for K in Ks if self.stages else ():  # a stage count given must fit with some F, T
            if all(k != K for k, _, _ in out):
                inner = [(name, list(n)) for name, n in (("fsdp", self.fsdp),
                                                         ("tensor", self.tensor)) if list(n) != [1]]
                over = "".join(f" x {name} in {n}" for name, n in inner)
                into = " x ".join(["data", "stages", *(name for name, _ in inner)])
                raise ConfigError(f"stages={K}{over} does not divide devices={devices}; the "
                                  f"search splits them into {into}")
        return out

    def tries(self, layouts: list[tuple[int, int, int]], devices: int, batch: int) -> list[Try]:
        """Every configuration of `layouts` whose replicas and micro-batches
        divide `batch`."""
        searched = [n for n, f in FAMILIES.items() if f.searched]
        out = []
        for K, F, T in layouts:
            R = devices // (K * F * T)
            if batch % R:
                continue
            per_replica = batch // R
            Ms = self.microbatches or [m for m in (K * 2 ** i for i in range(8))
                                       if m <= per_replica and per_replica % m == 0][:4]
            out += [Try(K, F, T, R, *c) for c in itertools.product(
                Ms, self.schedules or searched, self.remat, self.compute_dtypes)
                if per_replica % (c[0] * F) == 0]
        return out
