"""Synchronous schedules: one step runs M micro-batches through an empty
pipeline and applies one update, so the result equals un-pipelined training.

- GPipe (Huang et al. 2019, §2.2, Fig. 2c): all forwards, then all backwards.
- 1F1B, PipeDream-Flush (Narayanan et al. 2021): stage k runs K−k−1 warm-up
  forwards, then alternates one forward and one backward, then drains; same
  ticks and bubble as GPipe, but at most K micro-batches stashed per stage.
Both have bubble (K−1)/(M+K−1) and 2·(M+K−1) ticks. At K = 1 both are
micro-batched gradient accumulation: tick m runs micro-batch m's forward and
backward, which the executor fuses into one vjp that keeps nothing.
"""

from __future__ import annotations

from pipejax.errors import ConfigError
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op, Task, empty, put

FWD, BWD = 0, 1  # the lanes: a forward, then a fused backward


def _check(name: str, K: int, M: int) -> None:
    if K < 1 or M < 1:
        raise ConfigError(f"{name} needs K >= 1 stages and M >= 1 micro-batches, got K={K}, M={M}")


def _accumulation(name: str, M: int) -> Schedule:
    """One stage: F(0, m) and BW(0, m) at tick m, in that order."""
    table = empty(M, 1, 2)
    for m in range(M):
        put(table, m, 0, FWD, Task(Op.F, m))
        put(table, m, 0, BWD, Task(Op.BW, m))
    return Schedule(name, table, microbatches=M)


def gpipe(K: int, M: int) -> Schedule:
    """Fill-drain table: F(k, m) at tick m + k; BW(k, m) at tick (M+K−1) + (K−1−k) + m."""
    _check("gpipe", K, M)
    if K == 1:
        return _accumulation("gpipe", M)
    table = empty(2 * (M + K - 1), K, 2)
    for k in range(K):
        for m in range(M):
            put(table, m + k, k, FWD, Task(Op.F, m))
            put(table, (M + K - 1) + (K - 1 - k) + m, k, BWD, Task(Op.BW, m))
    return Schedule("gpipe", table, microbatches=M)


def one_f_one_b(K: int, M: int) -> Schedule:
    """PipeDream-Flush: each stage's op order is K−k−1 forwards, then
    (forward, backward) pairs, then the remaining backwards; every op runs at
    the first tick after its input (or gradient) arrived."""
    _check("1f1b", K, M)
    if K == 1:
        return _accumulation("1f1b", M)
    orders = []
    for k in range(K):
        warm = min(K - k - 1, M)
        order = [("F", m) for m in range(warm)]
        for i in range(M - warm):
            order += [("F", warm + i), ("B", i)]
        order += [("B", m) for m in range(M - warm, M)]
        orders.append(order)
    done: dict[tuple[str, int, int], int] = {}
    table = empty(2 * (M + K - 1), K, 2)
    nxt, t = [0] * K, 0
    while any(n < 2 * M for n in nxt):
        for k in range(K):
            if nxt[k] == 2 * M:
                continue
            op, m = orders[k][nxt[k]]
            need = (("F", k - 1, m) if k > 0 else None) if op == "F" else \
                (("B", k + 1, m) if k < K - 1 else ("F", k, m))
            if need is None or done.get(need, t) < t:
                put(table, t, k, *((FWD, Task(Op.F, m)) if op == "F" else (BWD, Task(Op.BW, m))))
                done[op, k, m] = t
                nxt[k] += 1
        t += 1
    return Schedule("1f1b", table[:t], microbatches=M)
