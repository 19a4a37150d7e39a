"""Asynchronous schedules: pipelines that never drain; each stage updates its
weights after every backward, so a micro-batch's gradient is stale by the
stage's delay D_k (SpecTrain §3.2; Kosson et al. 2020, §2).

Each table is ONE period of the steady state; step s runs it with micro-batch
ids s·M + relative id, so fill, steady state and drain are one program
(DESIGN.md). Relative ids below 0 are micro-batches fed by earlier steps.

- PipeDream (Harlap et al. 2018), asynchronous 1F1B: one op per stage and
  tick; F(k, g) at tick 2g + k, B(k, g) at tick 2g + 2K − 1 − k. Period 2M.
- Pipelined backpropagation (Kosson et al. 2020): every stage runs one forward
  and one backward per tick; F(k, g) at tick g + k, B(k, g) at tick
  g + 2K − 2 − k (the last stage runs both of a micro-batch in one tick).
  Period M; update size one micro-batch.
"""

from __future__ import annotations

import numpy as np

from pipejax.errors import ConfigError
from pipejax.schedules.schedule import NONE, Schedule


def _periodic(name: str, K: int, M: int, period: int, f_tick, b_tick) -> Schedule:
    """Place micro-batch g's ops at global ticks f_tick(k, g), b_tick(k, g)
    and fold them into one period, ids relative to the period's step."""
    if K < 1 or M < 1:
        raise ConfigError(f"{name} needs K >= 1 stages and M >= 1 micro-batches, got K={K}, M={M}")
    fwd = np.full((period, K), NONE, np.int64)
    bwd = np.full((period, K), NONE, np.int64)
    for k in range(K):
        for g in range(-4 * (K + M), 4 * (K + M)):
            for lane, tick in ((fwd, f_tick(k, g)), (bwd, b_tick(k, g))):
                step, t = divmod(tick, period)
                if step == 2:  # a steady-state period, far from the start
                    rel = g - 2 * M
                    if lane[t, k] not in (NONE, rel):
                        raise ConfigError(f"{name}: two ops on stage {k} at tick {t}")
                    lane[t, k] = rel
    return Schedule(name, fwd, bwd, microbatches=M, asynchronous=True)


def pipedream(K: int, M: int) -> Schedule:
    """Asynchronous 1F1B: F(k, g) at tick 2g + k, B(k, g) at 2g + 2K − 1 − k."""
    return _periodic("pipedream", K, M, 2 * M,
                     lambda k, g: 2 * g + k, lambda k, g: 2 * g + 2 * K - 1 - k)


def pb(K: int, M: int) -> Schedule:
    """Pipelined backpropagation: F(k, g) at tick g + k, B(k, g) at g + 2K − 2 − k."""
    return _periodic("pb", K, M, M, lambda k, g: g + k, lambda k, g: g + 2 * K - 2 - k)
