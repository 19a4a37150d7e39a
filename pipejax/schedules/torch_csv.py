"""Schedule tables in torch.distributed.pipelining's CSV ("compute_only").

One row per rank, one cell per time slot, empty for an idle slot; an
action is `{stage}{type}{micro-batch}` with global stage ids: `F` the
forward, `I` the input gradient (pipejax's B), `W` the weight gradient,
`B` the whole backward (pipejax's fused BW), and DualPipeV's
`(0F7;7B3)OVERLAP_F_B`, two actions in one slot. torch's communication
actions (SEND_F, RECV_B, ..., of its "compute_comms" format) are skipped:
the executor derives its messages from the table.

`read` takes the order of each rank's actions, not their slots: each
action runs at the earliest tick after what it needs and after its rank's
previous action (`greedy.in_order`), so a table keeps its meaning under
pipejax's tick (one op, messages between ticks). The ranks' stages fix
the placement (loop or V). `write` is the reverse, slot per tick; a tick
that fuses one micro-batch's forward and backward (the last stage's pair,
every tick at K = 1) becomes two slots, which read back one tick apart.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import NamedTuple

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.placement import KINDS, Placement
from pipejax.schedules.greedy import Step, in_order
from pipejax.schedules.tasks import NONE, Op, Task

_ACTION = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_COMMS = re.compile(r"^\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*$")
_OPS = {"F": Op.F, "I": Op.B, "W": Op.W, "B": Op.BW}
_LETTERS = {op: letter for letter, op in _OPS.items()}


class Action(NamedTuple):
    """One compute action of a rank: global stage j, op, micro-batch."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{_LETTERS[self.op]}{self.microbatch}"


def is_path(source: str | os.PathLike) -> bool:
    """Whether `source` names a file (else it is the CSV text itself)."""
    if isinstance(source, os.PathLike) or os.path.exists(source):
        return True
    if "\n" not in source and "," not in source and source.endswith(".csv"):
        raise ScheduleError(f"no schedule file {source!r}; give a path to torch's CSV or its text")
    return False


def _text(source: str | os.PathLike) -> str:
    """The CSV text of a path (a byte-order mark dropped), or `source` itself."""
    if is_path(source):
        with open(source, newline="", encoding="utf-8-sig") as f:
            return f.read()
    return str(source)


def parse(source: str | os.PathLike) -> list[list[tuple[Action, ...]]]:
    """Each rank's compute actions in order, a tuple per slot (two for an
    OVERLAP_F_B), idle slots and communication actions left out."""
    ranks = []
    rows = (row for row in csv.reader(io.StringIO(_text(source))) if any(c.strip() for c in row))
    for r, row in enumerate(rows):  # a blank line is not a rank
        steps = []
        for cell in (c.strip() for c in row):
            if not cell or _COMMS.match(cell):
                continue
            overlap = _OVERLAP.match(cell)
            parts = overlap.group(1).split(";") if overlap else [cell]
            actions = []
            for part in (p.strip() for p in parts):
                m = _ACTION.match(part)
                if not m:
                    raise ScheduleError(
                        f"rank {r}: cannot read action {part!r}; torch's compute_only format "
                        "writes {stage}{F|I|W|B}{micro-batch}, e.g. 0F1, or "
                        "(0F7;7B3)OVERLAP_F_B")
                actions.append(Action(int(m.group(1)), _OPS[m.group(2)], int(m.group(3))))
            if overlap and sorted(a.op == Op.F for a in actions) != [False, True]:
                raise ScheduleError(f"rank {r}: {cell} overlaps {len(actions)} actions; an "
                                    "OVERLAP_F_B pairs one forward with one backward, e.g. "
                                    "(0F7;7B3)OVERLAP_F_B")
            steps.append(tuple(actions))
        ranks.append(steps)
    if not ranks:
        raise ScheduleError("the schedule CSV has no rows; torch writes one row per rank")
    return ranks


def _placement(ranks: list[list[tuple[Action, ...]]]) -> Placement:
    """The loop or V placement of the ranks' stages, or an error naming the
    stage on two ranks or the map that is neither."""
    K, home = len(ranks), {}
    for r, steps in enumerate(ranks):
        for a in (a for step in steps for a in step):
            if home.setdefault(a.stage, r) != r:
                raise ScheduleError(f"rank {r}: action {a} runs stage {a.stage}, which rank "
                                    f"{home[a.stage]} runs too; a stage lives on one rank")
    S = max(home) + 1
    missing = sorted(set(range(S)) - set(home))
    if missing or S % K:
        raise ScheduleError(f"the table's {K} ranks run stages {sorted(home)}; every stage 0.."
                            f"{S - 1} needs a rank, and each of the {K} ranks the same count")
    for kind in KINDS:
        if kind == "v" and S == K:
            continue
        placement = Placement(K, S // K, kind)
        if all(placement.device(j) == r for j, r in home.items()):
            return placement
    raise ScheduleError(f"the table places stages on ranks as {dict(sorted(home.items()))}, "
                        "neither the loop (rank r holds stages r, r + K, ...) nor the V (rank r "
                        "holds r and 2K − 1 − r)")


def _check(ranks: list[list[tuple[Action, ...]]], placement: Placement, M: int) -> None:
    """Every stage runs each micro-batch's forward once and its backward once
    (B, or I then W), naming the rank and the action at fault."""
    seen: dict[tuple[int, Op, int], int] = {}
    for r, steps in enumerate(ranks):
        for a in (a for step in steps for a in step):
            if not 0 <= a.microbatch < M:
                raise ScheduleError(f"rank {r}: action {a} names micro-batch {a.microbatch} "
                                    f"outside 0..{M - 1} (microbatches={M})")
            if (a.stage, a.op, a.microbatch) in seen:
                raise ScheduleError(f"rank {r}: action {a} appears twice")
            if a.op == Op.W and (a.stage, Op.B, a.microbatch) not in seen:
                raise ScheduleError(f"rank {r}: action {a} (W) comes before its input "
                                    f"gradient {a.stage}I{a.microbatch}; W reads what I files")
            seen[a.stage, a.op, a.microbatch] = r
    for j in range(placement.chunks):
        r = placement.device(j)
        for m in range(M):
            has = lambda op: (j, op, m) in seen
            if not has(Op.F):
                raise ScheduleError(f"rank {r}: the forward {j}F{m} is missing")
            given = [f"{j}{_LETTERS[op]}{m}" for op in (Op.BW, Op.B, Op.W) if has(op)]
            if given not in ([f"{j}B{m}"], [f"{j}I{m}", f"{j}W{m}"]):
                what = f"runs it as {' and '.join(given)}" if given else "is missing"
                raise ScheduleError(f"rank {r}: the backward of stage {j}, micro-batch {m}, "
                                    f"{what}; give either {j}B{m} or {j}I{m} then {j}W{m}")


def read(source: str | os.PathLike, M: int, name: str) -> tuple[np.ndarray, Placement]:
    """The table and placement of torch's CSV (a path or its text) for M
    micro-batches, timed by its ranks' orders; a stall names the rank and
    the action it waits to run."""
    ranks = parse(source)
    placement = _placement(ranks)
    _check(ranks, placement, M)
    orders: list[list[Step]] = [
        [tuple(Task(a.op, a.microbatch, placement.local(a.stage)) for a in step) for step in steps]
        for steps in ranks]

    def describe(k: int, i: int) -> str:
        return (f"{' and '.join(map(str, ranks[k][i]))}, which needs an action that its rank or "
                "another runs only after it")

    return in_order(name, placement, M, orders, describe), placement


def write(table: np.ndarray, placement: Placement) -> str:
    """torch's CSV of a synchronous table: a slot per tick; a tick that runs
    a forward and another op is an OVERLAP_F_B."""
    rows = []
    for k in range(table.shape[1]):
        cells = []
        for t in range(table.shape[0]):
            ops = [Action(int(placement.chunk(k, c)), Op(op), int(m))
                   for op, m, c in table[t, k] if op != Op.IDLE and m != NONE]
            if len(ops) > 2 or (len(ops) == 2 and Op.F not in (a.op for a in ops)):
                raise ScheduleError(
                    f"tick {t}, rank {k} runs {' and '.join(map(str, ops))}; torch's format "
                    "holds one action per slot, or a forward and one other (OVERLAP_F_B)")
            ops.sort(key=lambda a: a.op != Op.F)
            fused = len(ops) == 2 and (ops[0].stage, ops[0].microbatch) == (ops[1].stage,
                                                                           ops[1].microbatch)
            if fused:  # one micro-batch's F and BW in one tick
                cells += map(str, ops)  # read back as two slots: the BW waits for its F
            else:
                cells.append("" if not ops else str(ops[0]) if len(ops) == 1 else
                             f"({';'.join(map(str, ops))})OVERLAP_F_B")
        while cells and not cells[-1]:  # torch does not pad a row
            cells.pop()
        rows.append(cells)
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()
