"""Zero-bubble schedules (Qi et al. 2024): the backward split into B, the
input gradient that the previous stage waits for, and W, the weight
gradient that nobody waits for, so W fills the ticks 1F1B leaves idle.

A device's rule, each tick (`greedy.greedy_table`), over its forwards and input
gradients in `rounds` order (virtual stages too, v ≥ 1):
1. a W, if k + 1 or more are pending;
2. the next forward, if ready and fewer than `limit(k)` micro-batch chunks
   are between their forward and their B;
3. the next B, if its gradient has arrived;
4. any pending W; else idle.

- zb-h1: limit (v−1)·K + K − k, 1F1B's stash (K micro-batches on device 0
  in stage units). The W's that wait fill the drain: 3·v·M + K − 1 ticks,
  bubble (K−1)/(3·v·M + K − 1) of the slots, the least any table reaches
  (the last device cannot start before tick K − 1, then runs 3·v·M ops).
  With F = B = W this is the paper's ZB-H1, bubble (K−1)(F+B−W) (§2.1).
- zb-h2: limit (v−1)·K + 2·(K−1−k) + 1, B before W and forward: the
  paper's ZB-H2 warm-up (§2.2), about twice the stash. In a step that starts
  and ends empty it has zb-h1's ticks: its zero bubble (K−1)(F+B−2W) comes
  from overlapping one step's drain with the next step's fill (the paper's
  optimizer post-validation, §4), which pipejax's synchronous step does not do.
"""

from __future__ import annotations

from typing import Callable

from pipejax.placement import Placement
from pipejax.schedules.greedy import greedy_table, rounds
from pipejax.schedules.interleaved import check_virtual
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op, Task

_ORDERS = {"zb-h1": ("W-due", "F", "B", "W"), "zb-h2": ("B", "W-due", "F", "W")}


def zero_bubble(name: str, K: int, M: int, v: int, limit: Callable[[int], int]) -> Schedule:
    """The table of the rule above with stash limit `limit(k)` for device k."""
    check_virtual(name, K, M, v)
    fwd = [Task(Op.F, m, c) for m, c in rounds(K, M, v)]
    inp = [Task(Op.B, m, c) for m, c in rounds(K, M, v, backward=True)]
    nf, nb, pending = [0] * K, [0] * K, [[] for _ in range(K)]

    def pick(k: int, ready: Callable[[Task], bool]) -> Task | None:
        for what in _ORDERS[name]:
            if what == "W-due" and len(pending[k]) >= k + 1 or what == "W" and pending[k]:
                m, c = pending[k].pop(0)
                return Task(Op.W, m, c)
            if (what == "F" and nf[k] < v * M and nf[k] - nb[k] < limit(k)
                    and ready(fwd[nf[k]])):
                nf[k] += 1
                return fwd[nf[k] - 1]
            if what == "B" and nb[k] < nf[k] and ready(inp[nb[k]]):
                task = inp[nb[k]]
                nb[k] += 1
                pending[k].append((task.microbatch, task.chunk))
                return task
        return None

    placement = Placement(K, v)
    return Schedule(name, greedy_table(name, placement, M, pick, [3 * v * M] * K), M,
                    placement=placement)


def zb_h1(K: int, M: int, v: int = 1) -> Schedule:
    """ZB-H1: 1F1B's memory, a third of its bubble (F = B = W)."""
    return zero_bubble("zb-h1", K, M, v, lambda k: (v - 1) * K + K - k)


def zb_h2(K: int, M: int, v: int = 1) -> Schedule:
    """ZB-H2: the paper's longer warm-up, about twice the in-flight activations."""
    return zero_bubble("zb-h2", K, M, v, lambda k: (v - 1) * K + 2 * (K - 1 - k) + 1)
