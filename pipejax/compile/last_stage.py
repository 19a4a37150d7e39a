"""When the last virtual stage's forward runs inside its backward.

The last stage's forward sends nothing on: it makes the loss, and what it
keeps only its own backward reads. So the executor runs the two as one vjp
(`StageCode.pair`, which keeps nothing, as a plain jit does):
- where a table runs both in one tick (`Schedule.fused`: every tick at
  K = 1, pipelined backpropagation's last stage);
- in a synchronous table whose last stage keeps nothing for its backward
  (remat "stage"; `deferred`), at the backward's tick, whatever the table
  runs at the forward's: the backward would replay the forward anyway, so
  the forward at its own tick was a stage's forward a micro-batch done
  twice (at K = 4 stages of equal cost, a forward, a replay and a backward
  of two forwards' work each: 16 forwards' work a micro-batch where 15
  do). A fused backward (BW) runs the pair; zero bubble's B runs
  the pair's split (split.py), which puts the forward and the loss in B
  and files what W reads of it in the bridge, as it does for a replay.
An asynchronous table's forward and backward run at different weights (an
update comes between), and a last stage that keeps residuals (remat
"none", a saving policy) made them at its forward's tick: fused into B,
they would grow the bridge ring, padded to its largest chunk, on every
device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from pipejax.compile.lanes import TickTask
from pipejax.schedules import Op, Schedule
from pipejax.schedules.tasks import BACKWARD


class Backwards(NamedTuple):
    """What the stage code needs to know of a table's backwards: whether it
    splits some into B and W (`split`: it has W ops), and whether the last
    stage's forward may run inside its backward (`may_defer`)."""

    split: bool = False
    may_defer: bool = False


def backwards(schedule: Schedule) -> Backwards:
    """`Backwards` of a table. The last stage's forward may run inside its
    backward in a synchronous table (no update comes between them) that
    runs at most one backward a device a tick (a tick reports one loss)."""
    one = bool((np.isin(schedule.ops, BACKWARD).sum(axis=2) <= 1).all())
    return Backwards(bool((schedule.ops == Op.W).any()), schedule.synchronous and one)


def deferred(backwards: Backwards, last_kept: Any) -> bool:
    """Whether the executor runs the last stage's forward inside its
    backward (B or BW): it may (`backwards.may_defer`) and the last stage
    keeps nothing (`last_kept`, its residuals' tree, has no leaves)."""
    return backwards.may_defer and not jax.tree.leaves(last_kept)


def pairs(tasks: dict[Op, TickTask], last: int, deferred: bool,
          fusion: bool) -> tuple[dict[Op, TickTask], TickTask | None]:
    """What each op's loop of a tick runs (`tasks`: a device's task in each
    lane), and the pair the backward runs as one vjp on the `last` virtual
    stage, or None: a forward and a BW of one micro-batch in one tick
    (`fusion`: the table has `Schedule.fused` cells), or every BW there
    where backwards run that stage's forwards (`deferred`: B in its
    branch), which then run in no loop of their own."""
    runs, f, b = dict(tasks), tasks[Op.F], tasks.get(Op.BW)
    if deferred:
        runs[Op.F] = f._replace(real=f.real & (f.j != last))
        if b is None:
            return runs, None
        fused = TickTask(b.g, b.real & (b.j == last), b.j, b.ring)
    elif fusion:
        fused = TickTask(f.g, f.real & b.real & (f.g == b.g) & (f.j == last) & (b.j == last),
                         f.j, f.ring)
        runs[Op.F] = f._replace(real=f.real & ~fused.real)
    else:
        return runs, None
    runs[Op.BW] = b._replace(real=b.real & ~fused.real)
    return runs, fused
