"""Reading a compiled step's HLO text: its computations, the loop over
ticks, and the instructions that run inside it.

`compiled.as_text()` lists computations; a `while` names its body, and
XLA annotates a loop whose trip count it knows (`known_trip_count`): the
scan over a table's ticks has T. Everything the tick's body calls (the
0-or-1-trip loops of the ops, the stage switch's branches) runs at most
once per trip of it. Benchmarks and tests count copies and collectives
with these helpers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipejax.compile import Layout

HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)="
                    r"%([\w.\-]+)|branch_computations=\{([^}]*)\}")
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def computations(text: str) -> dict[str, str]:
    """Each computation of an HLO text: name -> its instructions."""
    out, name = {}, None
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            name, out[header.group(1)] = header.group(1), ""
        elif line == "}":
            name = None
        elif name:
            out[name] += line + "\n"
    return out


LOOPS = re.compile(r" (?:while|call)\(.*?(?:body|condition|to_apply)=%([\w.\-]+)"
                   r"(?:, (?:body|condition|to_apply)=%([\w.\-]+))?")


def reachable(comps: dict[str, str], root: str, branches: bool = True) -> set[str]:
    """`root` and every computation it calls, directly or not; without
    `branches`, only the loops and calls around the stage switch (not the
    branches of a conditional nor fusions' bodies)."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        if not branches:
            todo += [n for pair in LOOPS.findall(comps[name]) for n in pair if n]
            continue
        todo += called(comps[name])
    return seen


def called(text: str) -> list[str]:
    """The computations an instruction (or a computation's text) calls."""
    return [n for one, many in CALLED.findall(text)
            for n in ([one] if one else [m.strip().lstrip("%") for m in many.split(",")])]


def tick_body(comps: dict[str, str], ticks: int) -> str:
    """The name of the body of the loop over `ticks` ticks (the scan)."""
    scan = next(line for body in comps.values() for line in body.splitlines()
                if " while(" in line and f'"known_trip_count":{{"n":"{ticks}"}}' in line)
    return re.search(r"body=%([\w.\-]+)", scan).group(1)


def tick_order(text: str, ticks: int) -> list[str]:
    """The ops' loops ("loop") and the sends ("send": collective-permutes,
    or the conditionals that run one at the ticks that send) of the tick's
    body in the order the compiled step runs them (a scheduled module lists
    a computation's instructions in that order)."""
    comps = computations(text)
    order = []
    for line in comps[tick_body(comps, ticks)].splitlines():
        kind = re.search(r" (while|collective-permute|conditional)(?:-start)?\(", line)
        if kind is None:
            continue
        sends = kind.group(1) == "collective-permute" or any(
            "collective-permute" in comps[n] for c in called(line) for n in reachable(comps, c))
        if kind.group(1) == "while" or sends:
            order.append("loop" if kind.group(1) == "while" else "send")
    return order


def nbytes(dtype: str, dims: str) -> int:
    """Bytes of an HLO shape such as f32[512,512] given as ("f32", "512,512")."""
    return int(np.prod([int(d) for d in dims.split(",") if d])) * BYTES.get(dtype, 4)


def per_tick(text: str, ticks: int, op: str) -> dict[str, int]:
    """How many `op` instructions (e.g. "all-gather") a compiled step holds:
    "tick", in the tick's body or what it calls (each runs at most once a
    tick), and "step", the others (outside the loop over ticks)."""
    comps = computations(text)
    inside = reachable(comps, tick_body(comps, ticks))
    found = re.compile(rf"= [^=]* {re.escape(op)}(?:-start)?\(")
    count = lambda name: len(found.findall(comps[name]))
    return {"tick": sum(count(n) for n in inside),
            "step": sum(count(n) for n in set(comps) - inside)}


# A buffer copied: a `copy` (or a fusion of nothing but copies and bitcasts)
# of a buffer the computation carries or was handed (a loop's state, a
# parameter, a broadcast, another copy), in a computation that is not a
# fusion's body. A copy of a value just computed, or a fusion that
# transposes what it copies, is a layout change, the arithmetic's own (a
# dot's operand turned, as a plain jit of the same model turns it), and a
# fusion that slices a ring's row out is a read: none counted.
MOVED = re.compile(r"^\s*%(?:wrapped_copy|copy|(?:bitcast_)*copy(?:_bitcast)*_fusion)[.\d]* = "
                   r"(\w+)\[([\d,]*)\]\S* (?:copy|fusion)\((?:%(?:get-tuple-element|param|"
                   r"wrapped_broadcast|broadcast|constant|copy)[\w.\-]*(?:, )?)+\)"
                   r"(?:.*?calls=%([\w.\-]+))?", re.M)


def tick_copies(text: str, ticks: int, shapes: set[str] | None = None) -> dict[str, list[int]]:
    """The bytes of the buffers copied (`MOVED`) by the table interpreter,
    of the HLO `shapes` given (e.g. `buffer_shapes`; all without): in the
    body of the scan over `ticks` ticks ("tick": at every tick) and in the
    loops it runs ("loops": an op's 0-or-1-trip loop and what it calls but
    the branches of a conditional, which run when their op does)."""
    comps = computations(text)
    body = tick_body(comps, ticks)
    read_or_turn = lambda fused: fused and re.search(r" (?:dynamic-slice|transpose)\(",
                                                     comps.get(fused, ""))
    sized = lambda name: [nbytes(d, dims) for d, dims, fused in MOVED.findall(comps[name])
                          if dims and not read_or_turn(fused)
                          and (shapes is None or f"{d}[{dims}]" in shapes)]
    loops = reachable(comps, body, branches=False) - {body}
    return {"tick": sized(body), "loops": [b for n in loops for b in sized(n)]}


HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32",
             "uint32": "u32", "int8": "s8", "uint8": "u8", "bool": "pred"}


def buffer_shapes(layout: "Layout") -> set[str]:
    """The HLO shapes of a pipeline's ring buffers (`compile/layout.Layout`),
    of one slot of each ring (activation-sized: a message, one
    micro-batch's kept residuals) and of its packed parameter slots
    (weight-sized)."""
    rings = [(layout.acts, layout.input_slots), (layout.acts, layout.grad_slots),
             (layout.kept, layout.kept_slots), (layout.bridge, layout.bridge_slots),
             (layout.pieces, layout.kept_slots if layout.weight_stashing else 1),
             (layout.params, 1)]
    out = set()
    for packing, n in rings:
        for dtype, shape in packing.slots if packing is not None else ():
            for dims in ((n, *shape), (1, *shape), shape):
                out.add(f"{HLO_TYPES.get(dtype, dtype)}[{','.join(map(str, dims))}]")
    return out
