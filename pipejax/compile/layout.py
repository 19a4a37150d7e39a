"""The buffer layout of a compiled pipeline, and what it costs.

Every device runs one program on buffers of one shape
(heterogeneous stages in SPMD), so each buffer is as large as the largest
stage needs. The `Layout` gathers, from the stage code and the schedule, the
packings (parameters, boundary activations, kept residuals) and the slots of
every ring buffer (the schedule's capacities), allocates the empty rings, and
reports the bytes: the padding a heterogeneous split pays and the memory of
weight stashing. The plan stays free of it (partition knows no devices).
"""

from __future__ import annotations

import dataclasses

from pipejax.packing import Packing
from pipejax.compile import rows, versions
from pipejax.compile.stages import StageCode
from pipejax.compile.state import Rings
from pipejax.formatting import human_bytes
from pipejax.schedules import Schedule, ring_capacities


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The ring-buffer slots of one compiled pipeline, and the packings of
    its stage code they hold: `params` (parameters), `acts` (boundary
    activations), `kept` (kept residuals) and `bridge` (what a split
    backward's B files for its W; None without W ops)."""

    params: Packing
    acts: Packing
    kept: Packing
    bridge: Packing | None
    input_slots: int
    grad_slots: int
    kept_slots: int
    data_slots: int
    weight_stashing: bool
    bridge_slots: int = 0
    fsdp: int = 1  # F, the devices a stage is sharded over: each holds a piece of `params`
    versions: bool = False  # two weight versions and a step's gradient (compile/versions.py)

    @classmethod
    def of(cls, code: StageCode, schedule: Schedule, weight_stashing: bool,
           fsdp: int = 1) -> "Layout":
        slots = ring_capacities(schedule)
        return cls(code.params, code.acts, code.kept, code.bridge, slots.inputs, slots.grads,
                   slots.residuals, slots.data, weight_stashing, slots.bridge, fsdp,
                   schedule.double_buffered)

    @property
    def pieces(self) -> Packing:
        """One device's piece of the parameter slots (all of them when F = 1)."""
        return self.params.shard(self.fsdp)

    def rings(self, lead: tuple[int, ...] = (), empty: bool = False) -> Rings:
        """Zero ring buffers of one device (`lead=(K,)` for all devices);
        with `empty`, buffers of any content (`lax.empty`: left unwritten on
        a GPU, zeros on a CPU) for a pass that reads only slots it wrote (a
        synchronous table: a slot is read by the task after the one that
        filled it, an invalid message is dropped)."""
        fill = lambda packing, n: rows.ring(packing, n, lead, empty)
        return Rings(grads=fill(self.acts, self.grad_slots),
                     kept=fill(self.kept, self.kept_slots),
                     inputs=fill(self.acts, self.input_slots),
                     weights=(self.pieces.empty if empty else self.pieces.zeros)(
                         (*lead, self.kept_slots)) if self.weight_stashing else (),
                     bridge=fill(self.bridge, self.bridge_slots) if self.bridge_slots else (),
                     versions=versions.zeros(self.pieces, lead) if self.versions else ())

    @property
    def padded_param_bytes(self) -> int:
        """Bytes of the packed parameter buffers over all K stages (of one
        tensor device: a split slot's column)."""
        return self.params.stages * self.params.slot_bytes()

    @property
    def padding_overhead(self) -> float:
        """Padded over real parameter bytes, minus one (0.0 means no padding)."""
        return self.params.padding()

    @property
    def weight_stash_bytes(self) -> int:
        """Extra memory per stage for weight stashing: one weight version per
        micro-batch between its forward and backward (0 if off)."""
        return self.kept_slots * self.pieces.slot_bytes() if self.weight_stashing else 0

    @property
    def versions_bytes(self) -> int:
        """Extra memory per stage for a double-buffered table: the previous
        weight version and the step's gradient sum (0 otherwise)."""
        return 2 * self.pieces.slot_bytes() if self.versions else 0

    def __str__(self) -> str:
        real = sum(self.params.used_bytes(k) for k in range(self.params.stages))
        rows = [("parameters", self.pieces.slot_bytes(), 1),
                ("ring: stage inputs", self.acts.slot_bytes(), self.input_slots),
                ("ring: output gradients", self.acts.slot_bytes(), self.grad_slots),
                ("ring: kept residuals", self.kept.slot_bytes(), self.kept_slots)]
        if self.weight_stashing:
            rows.append(("ring: stashed weights", self.pieces.slot_bytes(), self.kept_slots))
        if self.bridge_slots:
            rows.append(("ring: B to W (bridge)", self.bridge.slot_bytes(), self.bridge_slots))
        if self.versions:
            rows.append(("previous weights, step's gradient", self.pieces.slot_bytes(), 2))
        width = max(len(r[0]) for r in rows)
        lines = ["buffers of every device (each as large as the largest stage needs):"]
        lines += [f"  {name.ljust(width)}  {count} x {human_bytes(size)}" for name, size, count in rows]
        each = f" of each of {self.params.tensor} tensor devices" if self.params.tensor > 1 else ""
        lines.append(f"padded parameter buffers {human_bytes(self.padded_param_bytes)} for "
                     f"{human_bytes(real)} of parameters{each} "
                     f"({100 * self.padding_overhead:.1f}% padding)")
        return "\n".join(lines)
