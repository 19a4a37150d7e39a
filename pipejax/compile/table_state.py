"""What one pass over a schedule's table takes, carries from op to op within
a tick, and returns, seen from one device (inside shard_map): the table
interpreter's state (table.py, split_ops.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from pipejax.compile.lanes import Counters
from pipejax.compile.optimizer import OptState
from pipejax.compile.state import Rings
from pipejax.packing import Buffers


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

    p: Buffers
    s: OptState | tuple
    grad_sum: Any  # the step's gradient sum (synchronous), () otherwise
    rings: Rings  # carried through every op's loop: each reads its slots inside
    mail: tuple[Buffers, ...]  # the tick's messages (messages.letter), through every op's loop
    whole: tuple = ()  # a sharded stage's gathered weights (the forward's, the backward's)
