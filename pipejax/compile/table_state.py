"""What one pass over a schedule's table takes, carries from op to op within
a tick, and returns, seen from one device (inside shard_map): the table
interpreter's state (table.py, split_ops.py); and what every part of a tick
reads (`TickContext`), the contract between the tick and its parts (op_loops.py,
fsdp.py, split_ops.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax

from pipejax.compile.gradients import GradientPolicy
from pipejax.compile.lanes import Counters
from pipejax.compile.layout import Layout
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.compile.stages import StageCode
from pipejax.compile.state import Rings
from pipejax.packing import Buffers
from pipejax.schedules import Op


@dataclasses.dataclass(frozen=True, eq=False)
class TickContext:
    """What every op of a tick reads, made once a pass by `table._Tick`."""

    code: StageCode
    layout: Layout
    opts: StageOptimizers | None  # None: a pass without optimizers
    gradients: GradientPolicy  # how a weight gradient joins the sum; an op's weights' version
    branches: dict[Op, Callable]  # each op's branches of the stage switch
    per_chunk: bool  # a synchronous table over v > 1 chunks: W adds into its chunk's slots
    busy: bool  # every op runs at every tick: no loops
    sharded: bool  # the stage's weights are pieces, gathered whole for the tick's ops
    whole: Buffers | None  # gathered once before the pass (`Gather.STEP`), else None


class TableIn(NamedTuple):
    """One pass over the table, inputs seen from one device (inside shard_map)."""

    params: Buffers
    opt_state: OptState | tuple  # () for a pass without optimizers
    rings: Rings
    data: tuple  # (x, y) rings `[slots, mb, ...]`
    counters: Counters
    key: jax.Array


class TableOut(NamedTuple):
    """One pass over the table, seen from one device."""

    params: Buffers
    opt_state: OptState | tuple  # () for a pass without optimizers
    rings: Rings
    grads: Any  # accumulated packed gradients (synchronous tables), () otherwise
    losses: jax.Array  # [M] float32: each finished micro-batch's loss, mean over the replicas
    done: jax.Array  # [M] bool: which of them the pass finished
    skipped: jax.Array  # int32: updates the guard skipped (all stages and replicas)


class Ops(NamedTuple):
    """What the ops of one tick hand on to the next op and to the exchange."""

    params: Buffers
    opt_state: OptState | tuple
    grad_sum: Any  # the step's gradient sum (synchronous), () otherwise
    rings: Rings  # carried through every op's loop: each reads its slots inside
    mail: tuple[Buffers, ...]  # the tick's messages (messages.letter), through every op's loop
    whole: tuple = ()  # a sharded stage's gathered weights (the forward's, the backward's)
