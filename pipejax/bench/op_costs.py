"""What a step executes, from its table and the cost of each op.

XLA's cost analysis counts a loop body once, not once per trip, so the work
of a step is derived: every op of every virtual stage (F, the fused
backward BW, zero bubble's B and W) is compiled alone on abstract inputs,
and the table says how often each runs. `step_count` sums them over the
table's tasks (`pipejax.planner.paths.executed`), with the last stage's
forward and backward as one vjp where they run so."""

from __future__ import annotations

import functools
from typing import Callable

import jax

from pipejax.compile import StageCode, last_stage_cells, split_functions
from pipejax.planner.paths import executed
from pipejax.schedules import NONE, Op, Schedule
from pipejax.trace import cost_analysis


def _count(measure: str, fn: Callable, *args) -> float:
    """XLA's `measure` ("flops", "bytes accessed") of `fn` compiled alone
    (0 for an op with none)."""
    return float(cost_analysis(jax.jit(fn).lower(*args).compile()).get(measure, 0.0))


def op_counts(code: StageCode, measure: str = "flops") -> dict[Op, list[float]]:
    """XLA's `measure` of each op on each virtual stage: F (the forward with
    the residuals it keeps), BW, and with a split (`code.splits`) B and W.
    In bytes accessed an op reads and writes its rows of the rings: F the
    residuals it keeps, B the bridge, as their outputs."""
    out: dict[Op, list[float]] = {op: [] for op in (Op.F, Op.BW, Op.B, Op.W)}
    per_group: dict[Op, list[float]] = {op: [] for op in out}
    count = functools.partial(_count, measure)
    for j in code.groups.first:
        args = code.backward_args(j)
        params, h, feed, _, _ = args
        leaves, tree = jax.tree.flatten(args)
        per_group[Op.F].append(count(lambda p, h, f: code.vjp(j, p, h, f)[:2], params, h, feed))
        per_group[Op.BW].append(count(lambda *a: code.backward(j, *jax.tree.unflatten(tree, a)),
                                      *leaves))
        if code.splits:
            (b, b_args), (w, w_args) = split_functions(code, j)
            per_group[Op.B].append(count(b, *b_args))
            per_group[Op.W].append(count(w, *w_args))
    for op, costs in per_group.items():
        out[op] = [costs[g] for g in code.groups.of] if costs else []
    return out


def step_count(schedule: Schedule, code: StageCode, measure: str = "flops") -> float:
    """XLA's `measure` of a step over all its devices: every task of the
    table at its op's count compiled alone (`op_counts`), and a last
    stage's forward and backward that run as one vjp (compile/last_stage.py:
    a pair the table fuses, `Schedule.fused`, or every backward there that
    runs its forward, `code.deferred`) at the count of that vjp, which
    keeps nothing (`StageCode.pair`); a B that runs the forward counts it
    in its own."""
    counts = op_counts(code, measure)
    total = executed(schedule, counts)
    j = code.S - 1
    if code.deferred:
        forwards = int((last_stage_cells(schedule, (Op.F,)) != NONE).sum())
        pairs = int((last_stage_cells(schedule, (Op.BW,)) != NONE).sum())
        total -= forwards * counts[Op.F][j] + pairs * counts[Op.BW][j]
    else:
        pairs = int(schedule.fused.sum())
        total -= pairs * (counts[Op.F][j] + counts[Op.BW][j])
    if pairs:
        params, h, feed, _, _ = code.backward_args(j)
        total += pairs * _count(measure, code.pair, params, h, feed)
    return total


