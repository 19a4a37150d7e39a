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

import numpy as np

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


def reachable(comps: dict[str, str], root: str) -> set[str]:
    """`root` and every computation it calls, directly or not."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for one, many in CALLED.findall(comps[name]):
            todo += [one] if one else [n.strip().lstrip("%") for n in many.split(",")]
    return seen


def tick_body(comps: dict[str, str], ticks: int) -> str:
    """The name of the body of the loop over `ticks` ticks (the scan)."""
    scan = next(line for body in comps.values() for line in body.splitlines()
                if " while(" in line and f'"known_trip_count":{{"n":"{ticks}"}}' in line)
    return re.search(r"body=%([\w.\-]+)", scan).group(1)


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
