"""Tables from per-device policies: each tick, every device runs an op (or
a pair of ops) as soon as what it needs has arrived.

A synchronous schedule is fixed by what each device runs next (its order
of ops, or a rule over the ops that are ready); the ticks follow from the
dependencies: the forward of virtual stage j needs j − 1's forward of the
same micro-batch one tick earlier (the message travels between ticks), the
input gradient B needs j + 1's (or, on the last virtual stage, its own
forward), the weight gradient W its own B. `greedy_table` steps all devices
tick by tick and writes the table; `in_order` is the policy of a list of
ops per device (the V schedules, and tables read from CSV).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

from pipejax.errors import ScheduleError
from pipejax.placement import Placement
from pipejax.schedules.tasks import Op, Task, empty, put

Step = "Task | tuple[Task, ...] | None"  # what a device runs in one tick: an op, a pair, or idle
Pick = Callable[[int, Callable[[Task], bool]], Step]  # (device, ready) -> step


def tasks_of(step: Step) -> tuple[Task, ...]:
    """The tasks of a step: none (idle), one, or a pair."""
    return () if step is None else (step,) if isinstance(step, Task) else tuple(step)


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


def greedy_table(name: str, placement: Placement, M: int, pick: Pick, ops: Sequence[int],
                 waiting: Callable[[int], str] | None = None) -> np.ndarray:
    """The table of `pick`: each tick, device k runs `pick(k, ready)` (a
    task, a pair of tasks in one tick, or None: idle) until it ran `ops[k]`
    ops. One lane, or, where a device runs a pair, two: the
    forwards, then the other ops. A tick in which no device can run stalls
    for ever: `waiting(k)` names what device k waits for, in the error."""
    K = placement.stages
    progress, rows, t = Progress(placement), [], 0
    ran = [0] * K
    while any(r < n for r, n in zip(ran, ops)):
        row = [tasks_of(pick(k, lambda task, k=k: progress.ready(k, task, t)))
               if ran[k] < ops[k] else () for k in range(K)]
        if not any(row):
            stuck = [k for k in range(K) if ran[k] < ops[k]]
            what = "; ".join(f"device {k} waits to run {waiting(k)}" for k in stuck) if waiting \
                else f"devices {stuck} wait for ops that never run"
            raise ScheduleError(f"schedule {name!r} (K={K}, M={M}, v={placement.virtual}) "
                                f"stalls at tick {t}: {what}")
        for k, step in enumerate(row):
            for task in step:
                progress.run(k, task, t)
            ran[k] += len(step)
        rows.append(row)
        t += 1
    lanes = max(len(step) for row in rows for step in row)
    out = empty(len(rows), K, lanes)
    for tick, row in enumerate(rows):
        for k, step in enumerate(row):
            if len(step) == 2 and [task.op == Op.F for task in step].count(True) != 1:
                raise ScheduleError(f"schedule {name!r}: tick {tick}, device {k} runs "
                                    f"{' and '.join(map(task_name, step))} together; a tick "
                                    "pairs a forward with one other op")
            for task in step:
                put(out, tick, k, 0 if lanes == 1 or task.op == Op.F else 1, task)
    return out


class InOrder:
    """Each device runs its list in order (a task, or a tuple of tasks run
    in one tick), waiting while the next is not ready."""

    def __init__(self, orders: list[list[Step]],
                 describe: Callable[[int, int], str] | None = None):
        self.orders, self.next = orders, [0] * len(orders)
        self.describe = describe or (lambda k, i: " and ".join(
            map(task_name, tasks_of(self.orders[k][i]))))

    def __call__(self, k: int, ready: Callable[[Task], bool]) -> Step:
        if self.next[k] == len(self.orders[k]):
            return None
        step = self.orders[k][self.next[k]]
        if all(map(ready, tasks_of(step))):
            self.next[k] += 1
            return step
        return None

    def waiting(self, k: int) -> str:
        """What device k runs next (for a stall's error)."""
        if self.next[k] == len(self.orders[k]):
            return "nothing (its list is done)"
        return self.describe(k, self.next[k])

    def ops(self) -> list[int]:
        """Ops per device."""
        return [sum(len(tasks_of(step)) for step in order) for order in self.orders]


def in_order(name: str, placement: Placement, M: int, orders: list[list[Step]],
             describe: Callable[[int, int], str] | None = None) -> np.ndarray:
    """The table in which device k runs `orders[k]` in order, each op at the
    earliest tick after what it needs and after the device's previous op
    (`describe(k, i)`, if given, names device k's i-th step in a stall's error)."""
    pick = InOrder(orders, describe)
    return greedy_table(name, placement, M, pick, pick.ops(), pick.waiting)


def task_name(task: Task) -> str:
    """A task as the schedule pictures name it: op, micro-batch, local chunk."""
    return f"{task.op.name} of micro-batch {task.microbatch} on local chunk {task.chunk}"


def rounds(K: int, M: int, v: int, backward: bool = False) -> Iterable[tuple[int, int]]:
    """(micro-batch, chunk) in the order a device runs them with v chunks:
    micro-batches in rounds of K, each round through the chunks in turn
    (last chunk first for the backward), as Megatron's and torch's
    interleaved schedules order them."""
    for r in range(0, M, K):
        for c in (reversed(range(v)) if backward else range(v)):
            for m in range(r, min(r + K, M)):
                yield m, c
