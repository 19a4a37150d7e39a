"""Asynchronous schedules: pipelines that never drain; each stage updates its
weights after every backward, so a micro-batch's gradient is stale by the
stage's delay D_k (SpecTrain §3.2; Kosson et al. 2020, §2).

Each table is ONE period of the steady state; step s runs it with micro-batch
ids s·M + relative id, so fill, steady state and drain are one program.
Relative ids below 0 are micro-batches fed by earlier steps.

- PipeDream (Harlap et al. 2018), asynchronous 1F1B: one op per stage and
  tick; F(k, g) at tick 2g + k, B(k, g) at tick 2g + 2K − 1 − k. Period 2M;
  at K = 1, M: F and B of micro-batch g both at tick g, a fused pair
  (`Schedule.fused`) as under the other schedules at K = 1, with the same
  updates (delay 0). At K > 1 the last stage's F could move to its B's tick
  without changing any weights an op sees, but the table keeps one op per
  tick: the fused pair would add a third loop to every device's tick
  (measured no faster at K = 4, M = 8).
- Pipelined backpropagation (Kosson et al. 2020): every stage runs one forward
  and one backward per tick; F(k, g) at tick g + k, B(k, g) at tick
  g + 2K − 2 − k (the last stage runs both of a micro-batch in one tick).
  Period M; update size one micro-batch.
- PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel
  DNN Training", §3.1): PipeDream's table, double-buffered: a stage
  accumulates a step's M gradients and applies them once, and every op of
  step t runs on the version one behind, W(t − 1), so at every stage
  W(t + 1) = W(t) − ν·∇f(W(t − 1)): one step of delay whatever K, two
  weight versions a stage (compile/versions.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from pipejax.errors import ConfigError
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import NONE, Op, Task, empty, put

Tick = Callable[[int, int], int]  # (stage k, micro-batch g) -> global tick


def periodic(name: str, K: int, M: int, period: int, forward: Tick, backward: Tick) -> Schedule:
    """One period of the steady state, folded from the global ticks of each
    micro-batch's F (lane 0) and BW (lane 1), which must repeat every
    `period` ticks for every M micro-batches. Micro-batch g's op at tick T
    lands in cell T mod P (P = period) with relative id g − M·⌊T/P⌋: the
    period ⌊T/P⌋ sees it as fed ⌊T/P⌋ steps earlier."""
    if K < 1 or M < 1:
        raise ConfigError(f"{name} needs K >= 1 stages and M >= 1 micro-batches, got K={K}, M={M}")
    table = empty(period, K, 2)
    for k in range(K):
        for g in range(M):
            for lane, (op, tick) in enumerate(((Op.F, forward(k, g)), (Op.BW, backward(k, g)))):
                steps, t = divmod(tick, period)
                rel = g - M * steps
                if table[t, k, lane, 1] not in (NONE, rel):
                    raise ConfigError(f"{name}: two ops on stage {k} at tick {t}")
                put(table, t, k, lane, Task(op, rel))
    return Schedule(name, table, microbatches=M, asynchronous=True)


def pipedream(K: int, M: int) -> Schedule:
    """Asynchronous 1F1B: F(k, g) at tick 2g + k, BW(k, g) at 2g + 2K − 1 − k;
    at K = 1 both at tick g, fused (nothing comes between them)."""
    if K == 1:
        return periodic("pipedream", K, M, M, lambda k, g: g, lambda k, g: g)
    return periodic("pipedream", K, M, 2 * M,
                    lambda k, g: 2 * g + k, lambda k, g: 2 * g + 2 * K - 1 - k)


def pb(K: int, M: int) -> Schedule:
    """Pipelined backpropagation: F(k, g) at tick g + k, BW(k, g) at g + 2K − 2 − k."""
    return periodic("pb", K, M, M, lambda k, g: g + k, lambda k, g: g + 2 * K - 2 - k)


def two_bw(K: int, M: int) -> Schedule:
    """PipeDream-2BW: PipeDream's ticks, one update a step on the version one
    behind (`Schedule.double_buffered`); M >= K − 1 micro-batches a step."""
    if K > 1 and M < K - 1:
        raise ConfigError(f"2bw runs each step on one of two weight versions: with K={K} "
                          f"stages a step needs M >= {K - 1} micro-batches (M={M}), or the "
                          "first stage starts a step before the step two back has updated it")
    return dataclasses.replace(pipedream(K, M), name="2bw", double_buffered=True)
