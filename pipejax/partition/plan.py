"""A `Plan`: which layers each stage holds, and what each stage costs.

Built from the traced `LayerSpec`s and a split (from `balance` or the user).
Printing a plan gives the table a researcher checks before training: stage,
layer range and names, cost, parameter bytes and boundary activation bytes.
With v virtual stages per device the split has K·v contiguous chunks (the
virtual stages, in model order), placed on the devices by the pipeline's
`Placement` (placement.py); the table shows each chunk's device.
How stages are laid out in device buffers (and the padding that costs) is the
compiler's business: see `pipejax.compile.layout`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pipejax.errors import ConfigError
from pipejax.formatting import human_bytes, table
from pipejax.partition.balance import balance, check_split
from pipejax.partition.fold import balance_folded
from pipejax.partition.padding import within_padding
from pipejax.placement import Placement
from pipejax.trace import LayerSpec, nbytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """Layers per (virtual) stage and the cost, parameter bytes and boundary
    bytes of each; `placement` says which device holds each."""

    specs: tuple[LayerSpec, ...]
    split: tuple[int, ...]  # layers per virtual stage, K·v of them in model order
    objective: str
    placement: Placement

    @property
    def chunks(self) -> int:
        """S = K·v: the virtual stages (the stages when v = 1)."""
        return self.placement.chunks

    @property
    def stages(self) -> int:
        """K: the devices."""
        return self.placement.stages

    @property
    def ranges(self) -> list[range]:
        """Global layer indices of each virtual stage."""
        bounds = np.cumsum([0, *self.split])
        return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def device_layers(self, k: int) -> list[int]:
        """Global indices of device k's layers, chunk by chunk: the order of
        its parameter tree."""
        return [i for j in self.placement.device_chunks(k) for i in self.ranges[j]]

    @property
    def random_layers(self) -> list[LayerSpec]:
        """The layers that draw random numbers when training (dropout)."""
        return [s for s in self.specs if s.random]

    def stage_specs(self, j: int) -> tuple[LayerSpec, ...]:
        """The layers of virtual stage j."""
        return tuple(self.specs[i] for i in self.ranges[j])

    @property
    def costs(self) -> list[float | None]:
        """Cost of each virtual stage; None where a layer has no cost estimate."""
        costs = [[s.cost for s in self.stage_specs(j)] for j in range(self.chunks)]
        return [None if None in c else float(sum(c)) for c in costs]

    @property
    def param_bytes(self) -> list[int]:
        return [sum(s.param_bytes for s in self.stage_specs(j)) for j in range(self.chunks)]

    @property
    def boundary_bytes(self) -> list[int]:
        """Bytes of one micro-batch of each virtual stage's output (what it sends on)."""
        return [self.stage_specs(j)[-1].activation_bytes for j in range(self.chunks)]

    def __str__(self) -> str:
        chunked = self.placement.virtual > 1
        rows = [("chunk" if chunked else "stage", *(("device",) if chunked else ()), "layers",
                 "names", "cost", "share", "params", "sends")]
        costs = self.costs
        total = None if None in costs else (sum(costs) or 1.0)
        for j, r in enumerate(self.ranges):
            names = ",".join(s.name for s in self.stage_specs(j))
            if len(names) > 40:
                names = names[:37] + "..."
            sends = human_bytes(self.boundary_bytes[j]) if j < self.chunks - 1 else "-"
            cost, share = ("n/a", "n/a") if total is None else \
                (f"{costs[j]:.3g}", f"{100 * costs[j] / total:.1f}%")
            rows.append((str(j), *((str(self.placement.device(j)),) if chunked else ()),
                         f"{r.start}-{r.stop - 1}", names, cost, share,
                         human_bytes(self.param_bytes[j]), sends))
        lines = [table(rows)]
        cost_kind = "measured seconds" if self.specs[0].seconds is not None else "fwd+bwd FLOPs"
        lines.append(f"objective {self.objective}, cost = {cost_kind}")
        if chunked:
            lines.append(str(self.placement))
        unknown = [s for s in self.specs if s.cost is None]
        if unknown:
            lines.append("no cost estimate (XLA's cost analysis gave none) for layers " +
                         ", ".join(f"{s.index} ({s.name})" for s in unknown))
        return "\n".join(lines)


def make_plan(specs: Sequence[LayerSpec], placement: Placement,
              partition: str | Sequence[int] = "variance", max_bytes: float | None = None,
              in_flight: Sequence[int] | None = None, keeps_activations: bool = False,
              max_padding: float | None = None) -> Plan:
    """Split traced layers into the K·v contiguous (virtual) stages of `placement`.

    `partition` is "variance" (GPipe), "bottleneck" (PipeDream) or an explicit
    list of layer counts per stage. `max_bytes` bounds each stage's
    parameters with their gradient and two optimizer moments (4 copies), plus
    its input and (`keeps_activations`: remat "none") its layers' inputs for
    each of the `in_flight[k]` micro-batches stage k holds at once.
    `max_padding` keeps the packed parameters' padding within that fraction
    of their bytes, at the price of balance (padding.py). With v chunks per
    device the K·v chunks are balanced as stages, but a V of two chunks a
    device balances its devices first (fold.py); `partition` lists K·v counts.
    """
    specs, virtual = tuple(specs), placement.virtual
    if virtual > 1 and max_bytes is not None:
        raise ConfigError(
            f"max_bytes bounds each stage's bytes, but with virtual={virtual} a device holds "
            f"{virtual} chunks that are not next to each other, whose sum the exact partitioner "
            "does not bound; use virtual=1, or check pipe.layout and trainer.memory()")
    if virtual > 1 and max_padding is not None:
        raise ConfigError(
            f"max_padding bounds the padding of each device's packed parameters, but with "
            f"virtual={virtual} a device packs {virtual} chunks that are not next to each other, "
            "which the padding search does not cover; use virtual=1, or check pipe.layout")
    stages = placement.chunks
    if virtual > 1 and isinstance(partition, (list, tuple)) and len(partition) != stages:
        raise ConfigError(f"partition {list(partition)} has {len(partition)} entries; with "
                          f"stages={placement.stages} and virtual={virtual} give one layer count "
                          f"per chunk, {stages} in model order; {placement}")
    if isinstance(partition, str):
        unknown = [s for s in specs if s.cost is None] if stages > 1 else []  # one stage: no costs
        if unknown:
            names = ", ".join(f"{s.index} ({s.name})" for s in unknown[:5])
            raise ConfigError(
                f"partition={partition!r} balances layer costs, but XLA's cost analysis gave no FLOP "
                f"count for layers {names}{' ...' if len(unknown) > 5 else ''}; use cost='time' to "
                "measure every layer, or give the split yourself, e.g. partition=[3, 2, 2]")
        inputs = [nbytes(s.input) for s in specs]
        costs = [s.cost or 0.0 for s in specs]
        if placement.kind == "v" and virtual == 2:
            split = balance_folded(costs, placement.stages, partition)
        else:
            split = balance(costs, stages, partition, max_bytes,
                            memory=[4 * s.param_bytes for s in specs], inputs=inputs,
                            stash=inputs if keeps_activations else None, in_flight=in_flight)
        if max_padding is not None:
            if max_bytes is not None:
                raise ConfigError("give max_bytes or max_padding, not both: each bounds the "
                                  "bytes of every stage")
            split = within_padding(specs, stages, partition, max_padding, split)
        objective = partition
    elif isinstance(partition, (list, tuple)):
        if max_padding is not None:
            raise ConfigError("max_padding chooses among splits; an explicit partition has none "
                              "to choose: give partition='variance' or 'bottleneck'")
        split = check_split(partition, len(specs), stages)
        objective = "explicit"
    else:
        raise ConfigError(f"partition must be 'variance', 'bottleneck' or a list of layer "
                          f"counts, not {partition!r}")
    return Plan(specs=specs, split=split, objective=objective, placement=placement)

