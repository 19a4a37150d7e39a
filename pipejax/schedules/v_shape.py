"""Schedules on the V placement: device k holds chunks k and 2K − 1 − k
(`Placement(K, 2, "v")`), so a micro-batch goes down the devices and back
up, and the loss's backward starts on device 0, where the forward began.

Each device runs a list of ops in the order torch.distributed.pipelining
writes it (`ScheduleZBVZeroBubble`, `ScheduleDualPipeV`, PyTorch 2.13); the
ticks follow from the dependencies (`greedy.in_order`), as for a table read
from torch's CSV. Local chunk 0 is the way down, 1 the way back up.

- zb-v (Qi et al. 2024, §6): zero bubble's split backward (B the input
  gradient, W the weight gradient) on the V: the warm-up fills both chunks,
  the steady state alternates F, B, W on each chunk, and the W's fill the
  drain. With F = B = W its bubble is zero, at 1F1B's activation memory.
- dualpipev (DeepSeek-V3 report, arXiv 2412.19437, §3.2.1, DualPipe folded
  onto the V as torch defines it): the steady state runs an F of one chunk
  and a fused backward (BW) of the other in the same tick (two lanes; on
  GPUs the pair overlaps its compute and its communication), and the
  drain splits the second half of the backwards into B and W.

torch builds both for M ≥ 2K − 1 (ZB-V) and M ≥ 2K (DualPipeV); with
fewer micro-batches, as torch does for ZB-V, the order of the larger M is
kept and the missing micro-batches' ops left out (a subset closed under the
dependencies, so the order still runs).
"""

from __future__ import annotations

from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules.greedy import Step, in_order, tasks_of
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op, Task


def _v_schedule(name: str, K: int, M: int, orders: list[list[Step]]) -> Schedule:
    """The V table of `orders` with micro-batches M and above left out."""
    kept = []
    for order in orders:
        steps = (tuple(t for t in tasks_of(step) if t.microbatch < M) for step in order)
        kept.append([step for step in steps if step])
    placement = Placement(K, 2, "v")
    return Schedule(name, in_order(name, placement, M, kept), M, placement=placement)


def _check(name: str, K: int, M: int) -> None:
    if K < 1 or M < 1:
        raise ConfigError(f"{name} needs K >= 1 stages and M >= 1 micro-batches, got K={K}, "
                          f"M={M}")


def zb_v(K: int, M: int) -> Schedule:
    """ZB-V: each device's order as `ScheduleZBVZeroBubble` writes it."""
    _check("zb-v", K, M)
    n = max(2 * K - 1, M)
    orders = []
    for k in range(K):
        order: list[Step] = []
        count = {(op, c): 0 for op in Op for c in (0, 1)}

        def add(*ops: Op, c: int) -> None:
            for op in ops:  # each op of a chunk counts its micro-batches, as torch's
                order.append(Task(op, count[op, c], c))
                count[op, c] += 1

        add(*[Op.F] * (2 * (K - k) - 1), c=0)
        for _ in range(k):
            add(Op.F, c=1)
            add(Op.F, c=0)
        for _ in range(K - k):
            add(Op.F, Op.B, Op.W, c=1)
        while count[Op.F, 1] < count[Op.F, 0] or count[Op.F, 0] < n:
            add(*([Op.F] if count[Op.F, 0] < n else []), Op.B, Op.W, c=0)
            add(Op.F, Op.B, Op.W, c=1)
        for _ in range(k):
            add(Op.B, c=0)
            add(Op.B, c=1)
        for _ in range(K - k):
            add(Op.B, Op.W, c=0)
        for c in (1, 0):
            add(*[Op.W] * (count[Op.B, c] - count[Op.W, c]), c=c)
        orders.append(order)
    return _v_schedule("zb-v", K, M, orders)


class _DualOrder:
    """One device's DualPipeV order, with torch's counters: a fused
    backward (BW) counts as both B and W; a B queues its W."""

    def __init__(self):
        self.order: list[Step] = []
        self.count = {(op, c): 0 for op in (Op.F, Op.B, Op.W) for c in (0, 1)}
        self.weights: list[tuple[int, int]] = []  # (chunk, micro-batch) of B's without W

    def task(self, op: Op, c: int) -> Task:
        key = (Op.B if op == Op.BW else op, c)
        task = Task(op, self.count[key], c)
        self.count[key] += 1
        if op == Op.BW:
            self.count[Op.W, c] += 1
        elif op == Op.B:
            self.weights.append((c, task.microbatch))
        return task

    def add(self, op: Op, c: int) -> None:
        self.order.append(self.task(op, c))

    def overlap(self, forward: int, backward: int) -> None:
        """An F of chunk `forward` and a BW of chunk `backward` in one tick."""
        self.order.append((self.task(Op.F, forward), self.task(Op.BW, backward)))

    def weight(self) -> None:
        """The oldest pending W, if any."""
        if self.weights:
            c, m = self.weights.pop(0)
            self.order.append(Task(Op.W, m, c))
            self.count[Op.W, c] += 1


def dualpipev(K: int, M: int) -> Schedule:
    """DualPipeV: each device's order as `ScheduleDualPipeV` writes it."""
    _check("dualpipev", K, M)
    n = max(M, 2 * K)
    orders = []
    for k in range(K):
        d = _DualOrder()
        for _ in range(2 * (K - k - 1)):
            d.add(Op.F, 0)
        for _ in range(k + 1):
            d.add(Op.F, 0)
            d.add(Op.F, 1)
        for _ in range(K - k - 1):
            d.add(Op.B, 1)
            d.weight()
            d.add(Op.F, 1)
        for i in range(n - 2 * K + k + 1):
            if i == 0 and k == K - 1:  # not overlapped, to shorten the bubble
                d.add(Op.F, 0)
                d.add(Op.BW, 1)
            else:
                d.overlap(0, 1)
            d.overlap(1, 0)
        for _ in range(K - k - 1):
            d.add(Op.BW, 1)
            d.overlap(1, 0)
        split = False
        for i in range(k + 1):
            split = split or (i == (k + 1) // 2 and k % 2 == 1)
            d.add(Op.B if split else Op.BW, 1)
            split = split or (i == (k + 1) // 2 and k % 2 == 0)
            d.add(Op.B if split else Op.BW, 0)
        for _ in range(K - k - 1):
            d.weight()
            d.add(Op.B if split else Op.BW, 0)
        for _ in range(k + 1):
            d.weight()
        orders.append(d.order)
    return _v_schedule("dualpipev", K, M, orders)
