"""No collective inside a stage's branch that a device of its group skips.

Every device runs one program, and stage k's code is the branch of a switch
(or the trip of a 0-or-1-trip loop) that only stage k's devices take
(sharing.py, op_loops.py). A collective there whose devices span stages
waits for devices that never come: XLA CPU's rendezvous waits 40 s, then
aborts the process ("Expected 8 threads to join the rendezvous, but only 4
of them arrived"), and a GPU hangs. The executor keeps its own collectives
outside the branches, but XLA's SPMD partitioner, which splits a stage's
operations over the automatic axis `tensor` (tensor.py), inserts the
collectives it needs where the operation is. Measured: an NNX attention
with flat q/k kernels split over tensor = 4 and 2 heads of 16 (a device's
8 columns are half a head), whose rotary embedding slices each head in two
halves, compiles a `collective-permute` over all 8 devices into stage 0's
backward; at tensor = 2 the halves stay on one device and the step runs.

So the regions that stages run differently are marked (`varying`, a named
scope that survives into the compiled HLO's metadata), and before a
program's first run `check` reads the compiled HLO: a collective reachable
from a marked conditional or loop must keep each of its groups inside one
stage (a `collective-permute` joins every device its pairs name, in one
rendezvous). What breaks the rule is a `ConfigError` that names the stages,
the op and the user's line that made it. With one stage, or no `tensor`
axis (every axis manual: only the executor's collectives), nothing is read.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax.errors import ConfigError
from pipejax.mesh import STAGE, tensor_degree

MARK = "pipejax_varying"  # the scope of control flow whose path depends on the stage
_STAGES = "pipejax_stages_"  # the scope of one branch: the stages that run it
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_CALLS = re.compile(r"\b(?:condition|body|to_apply|calls|true_computation|false_computation)"
                    r"=(%[\w.\-]+)|branch_computations=\{([^}]*)\}")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%[\w.\-]+ = .*? ([a-z][\w\-]*)\(")


@contextlib.contextmanager
def varying() -> Iterator[None]:
    """Trace control flow that stages take differently under this scope."""
    with jax.named_scope(MARK):
        yield


def branch_of(stages: Sequence[int], fn: Any) -> Any:
    """`fn` traced under a scope that names the stages whose branch it is."""
    def branch(*args):
        with jax.named_scope(_STAGES + "_".join(map(str, stages))):
            return fn(*args)
    return branch


class Hazard(NamedTuple):
    """A collective in a varying region whose devices span stages."""

    op: str  # the HLO op, e.g. "collective-permute"
    stages: tuple[int, ...]  # the stages whose devices it joins
    branch: tuple[int, ...] | None  # the stages whose branch holds it, where the HLO says
    source: str  # the user's line that made it, or the op's path


def hazards(hlo: str, mesh: Mesh) -> list[Hazard]:
    """The collectives of compiled `hlo` (its text, with metadata) that sit
    in a varying region and join devices of several stages of `mesh`."""
    comps = _computations(hlo)
    frames = _Frames(hlo)
    inside = set()
    todo = [c for lines in comps.values() for line in lines
            if _op(line) in ("conditional", "while") and MARK in _op_name(line)
            for c in _callees(line)]
    while todo:
        c = todo.pop()
        if c not in inside and c in comps:
            inside.add(c)
            todo.extend(x for line in comps[c] for x in _callees(line))
    stage_of = np.unravel_index(np.arange(mesh.devices.size),
                                mesh.devices.shape)[mesh.axis_names.index(STAGE)]
    out = []
    for c, lines in comps.items():
        for line in lines:
            op = _op(line)
            base = op.removesuffix("-start")
            if base not in _COLLECTIVES or not (c in inside or MARK in _op_name(line)):
                continue
            spans = [sorted({int(stage_of[d]) for d in g}) for g in _groups(line, mesh.devices.size)]
            wide = sorted({s for g in spans if len(g) > 1 for s in g})
            if wide:
                out.append(Hazard(base, tuple(wide), _branch(_op_name(line)), frames.source(line)))
    return out


def permutes(hlo: str) -> tuple[str, ...]:
    """The source lines of the collective-permutes in compiled `hlo`, a
    stage's code compiled alone over its tensor group (tensor.py): in the
    pipeline such a permute's pairs repeat over every manual axis, so it
    joins the devices of every stage (measured: pairs {0,1}, {2,3}, {4,5},
    {6,7} at K = 2, tensor = 4), which a branch cannot hold."""
    frames = _Frames(hlo)
    return tuple(sorted({frames.source(line) for lines in _computations(hlo).values()
                         for line in lines
                         if _op(line).removesuffix("-start") == "collective-permute"}))


def applies(mesh: Mesh) -> bool:
    """Whether a program on `mesh` can hold such a collective: several
    stages, and a `tensor` axis for XLA's partitioner to split over."""
    return mesh.shape[STAGE] > 1 and tensor_degree(mesh) > 1


def check(compiled: Any, mesh: Mesh, where: str) -> None:
    """Raise a `ConfigError` if `compiled` (a `jax.stages.Compiled` on
    `mesh`) has a collective that some devices of its group would skip."""
    if not applies(mesh):
        return
    found = hazards(compiled.as_text(), mesh)
    if not found:
        return
    h = found[0]
    holder = (f"stage {_names(h.branch)}'s code" if h.branch else "a stage's code")
    raise ConfigError(
        f"{where}: XLA's partitioner put a {h.op} into {holder} ({h.source}) that joins the "
        f"devices of stages {_names(h.stages)}, but only the stage that runs that code reaches "
        f"it: the step would hang (XLA CPU aborts the process after 40 s). It splits an "
        f"operation over tensor = {tensor_degree(mesh)} across the split: most often attention "
        "heads that the tensor degree does not divide, sliced or reshaped per head (rotary "
        "embeddings); use a tensor degree that divides the number of heads, or give these "
        "devices to fsdp or data")


class Checked:
    """A jitted function whose compiled program is `check`ed on its first
    call (and whenever it is compiled through `lower(...).compile()`)."""

    def __init__(self, fn: Any, mesh: Mesh, where: str):
        self._fn, self._mesh, self._where, self._checked = fn, mesh, where, False

    def __call__(self, *args, **kwargs):
        if not self._checked and applies(self._mesh):
            self.lower(*args, **kwargs).compile()
        return self._fn(*args, **kwargs)

    def lower(self, *args, **kwargs) -> "_Lowered":
        return _Lowered(self._fn.lower(*args, **kwargs), self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


class _Lowered:
    def __init__(self, lowered: Any, owner: Checked):
        self._lowered, self._owner = lowered, owner

    def compile(self, *args, **kwargs) -> Any:
        compiled = self._lowered.compile(*args, **kwargs)
        check(compiled, self._owner._mesh, self._owner._where)
        self._owner._checked = True
        return compiled

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lowered, name)


def _names(stages: Sequence[int]) -> str:
    return ", ".join(map(str, stages[:-1])) + (" and " if len(stages) > 1 else "") + str(stages[-1])


def _computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    lines = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            lines = comps.setdefault(head.group(1), [])
        elif line.startswith("}"):
            lines = None
        elif lines is not None:
            lines.append(line)
    return comps


def _op(line: str) -> str:
    m = _INSTRUCTION.match(line)
    return m.group(1) if m else ""


def _op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def _callees(line: str) -> list[str]:
    out = []
    for one, many in _CALLS.findall(line):
        out.extend([one] if one else [c.strip() for c in many.split(",")])
    return out


def _branch(op_name: str) -> tuple[int, ...] | None:
    found = re.findall(_STAGES + r"([\d_]+)", op_name)
    return tuple(int(s) for s in found[-1].split("_")) if found else None


def _groups(line: str, devices: int) -> list[list[int]]:
    """The device groups that meet in one rendezvous of a collective."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs is not None:
        return [sorted({int(d) for d in re.findall(r"\d+", pairs.group(1))})]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota is not None:
        shape, dims, perm = (tuple(int(n) for n in g.split(",")) if g else None
                             for g in iota.groups())
        ids = np.arange(np.prod(dims)).reshape(dims)
        return ids.transpose(perm).reshape(shape).reshape(shape[0], -1).tolist()
    listed = re.search(r"replica_groups=\{(\{[\d,{} ]*\})?\}", line)
    if listed is not None and listed.group(1):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}",
                                                                       listed.group(1))]
    return [list(range(devices))]  # no groups: every device


class _Frames:
    """The compiled HLO's stack frame table: an op's innermost source line."""

    def __init__(self, hlo: str):
        def table(name: str) -> dict[str, str]:
            m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", hlo, re.S | re.M)
            return dict(line.split(" ", 1) for line in m.group(1).splitlines()) if m else {}
        self._files, self._functions = table("FileNames"), table("FunctionNames")
        self._locations, self._frames = table("FileLocations"), table("StackFrames")

    def source(self, line: str) -> str:
        frame = re.search(r"stack_frame_id=(\d+)", line)
        try:
            location = re.search(r"file_location_id=(\d+)", self._frames[frame.group(1)]).group(1)
            fields = dict(re.findall(r"(\w+)=(\d+)", self._locations[location]))
            file = self._files[fields["file_name_id"]].strip('"')
            function = self._functions[fields["function_name_id"]].strip('"')
            return f"{file}:{fields['line']}, in {function}"
        except (AttributeError, KeyError):
            return _op_name(line) or "an op without a source line"
