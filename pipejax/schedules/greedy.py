"""Tables from per-device policies: each tick, every device runs one op as
soon as what it needs has arrived.

A synchronous schedule is fixed by what each device runs next (its order
of ops, or a rule over the ops that are ready); the ticks follow from the
dependencies: the forward of virtual stage j needs j − 1's forward of the
same micro-batch one tick earlier (the message travels between ticks), the
input gradient B needs j + 1's (or, on the last virtual stage, its own
forward), the weight gradient W its own B. `greedy_table` steps all devices
tick by tick and writes a one-lane table (one op per device and tick).
"""

from __future__ import annotations

from typing import Callable, Iterable

from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op, Task, empty, put

Pick = Callable[[int, Callable[[Task], bool]], "Task | None"]  # (device, ready) -> task


class Progress:
    """What has run so far: the tick of every (op, virtual stage, micro-batch)."""

    def __init__(self, placement: Placement):
        self.placement, self.S = placement, placement.chunks
        self.done: dict[tuple[Op, int, int], int] = {}

    def stage(self, k: int, task: Task) -> int:
        """The virtual stage of `task` on device k."""
        return self.placement.chunk(k, task.chunk)

    def ready(self, k: int, task: Task, t: int) -> bool:
        """Whether `task` on device k may run at tick t."""
        j, m = self.stage(k, task), task.microbatch
        before = lambda op, i: self.done.get((op, i, m), t) < t
        if task.op == Op.F:
            return j == 0 or before(Op.F, j - 1)
        if task.op in (Op.B, Op.BW):
            return before(Op.F, j) if j == self.S - 1 else before(Op.B, j + 1)
        return before(Op.B, j)  # W

    def run(self, k: int, task: Task, t: int) -> None:
        j = self.stage(k, task)
        for op in ((Op.B, Op.W) if task.op == Op.BW else (task.op,)):
            self.done[op, j, task.microbatch] = t


def greedy_table(name: str, K: int, M: int, v: int, pick: Pick, ops: int) -> Schedule:
    """The table of `pick`: each tick, device k runs `pick(k, ready)` (None:
    idle), until every device ran `ops` ops."""
    placement = Placement(K, v)
    progress, table, t = Progress(placement), [], 0
    ran = [0] * K
    limit = 4 * (ops + K * v)  # a policy that cannot finish stalls well before this
    while min(ran) < ops:
        if t > limit:
            raise ConfigError(f"schedule {name!r} (K={K}, M={M}, v={v}) stalls: a device waits "
                              "for an op that never runs")
        row = []
        for k in range(K):
            task = pick(k, lambda task, k=k: progress.ready(k, task, t)) if ran[k] < ops else None
            row.append(task)
        for k, task in enumerate(row):
            if task is not None:
                progress.run(k, task, t)
                ran[k] += 1
        table.append(row)
        t += 1
    out = empty(len(table), K, 1)
    for tick, row in enumerate(table):
        for k, task in enumerate(row):
            if task is not None:
                put(out, tick, k, 0, task)
    return Schedule(name, out, microbatches=M, placement=placement)


def in_order(orders: list[list[Task]]) -> Pick:
    """Each device runs its list in order, waiting while the next is not ready."""
    nxt = [0] * len(orders)

    def pick(k: int, ready: Callable[[Task], bool]) -> Task | None:
        if nxt[k] < len(orders[k]) and ready(orders[k][nxt[k]]):
            nxt[k] += 1
            return orders[k][nxt[k] - 1]
        return None

    return pick


def rounds(K: int, M: int, v: int, backward: bool = False) -> Iterable[tuple[int, int]]:
    """(micro-batch, chunk) in the order a device runs them with v chunks:
    micro-batches in rounds of K, each round through the chunks in turn
    (last chunk first for the backward), as Megatron's and torch's
    interleaved schedules order them."""
    for r in range(0, M, K):
        for c in (reversed(range(v)) if backward else range(v)):
            for m in range(r, min(r + K, M)):
                yield m, c
