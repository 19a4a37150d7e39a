"""The synchronous programs: `value_and_grad` and the training step.

A synchronous table (GPipe, 1F1B) runs M micro-batches from an empty pipeline
to an empty one in one pass; the gradients of the micro-batches' mean loss
are accumulated and each stage applies one update on its own device (GPipe
§2), so a step equals the sequential computation on the whole batch. Dropout
keys: step key fold_in(state.key, step), micro-batch m fold_in(., m), layer i
fold_in(., i), as a sequential run derives them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from pipejax.compile import microbatch
from pipejax.compile.layout import Layout
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.spmd import REPLICATED, STAGED, lead, local, shard, stage_index
from pipejax.compile.stages import StageCode
from pipejax.compile.state import Staged, TrainState
from pipejax.compile.table import TableOut, metrics, run_table
from pipejax.schedules import Schedule


def _pass(code: StageCode, schedule: Schedule, layout: Layout, p: Any, s: Any, x: Any, y: Any,
          key: jax.Array) -> TableOut:
    """Inside shard_map: the table once over a batch `[M, mb, ...]`."""
    counters = (jnp.int32(0), jnp.int32(0), jnp.int32(schedule.microbatches))
    return run_table(code, schedule, layout, p, s, layout.rings(), (x, y), counters, key)


def value_and_grad(code: StageCode, schedule: Schedule, layout: Layout, mesh: Mesh, example: Any,
                   targets: Any) -> Callable:
    """`(params, batch, key) -> (mean loss over the micro-batches, its gradient)`."""
    M = schedule.microbatches

    def body(p, x, y, key):
        out = _pass(code, schedule, layout, local(p), (), x, y, key)
        return jnp.mean(out.losses), lead(out.grads)

    sharded = shard(body, mesh, (STAGED, REPLICATED, REPLICATED, REPLICATED), (REPLICATED, STAGED))

    def run(params: Staged, batch: tuple, key: jax.Array):
        x, y = microbatch.split(batch, M, example, targets)
        loss, grads = sharded(params.buffers, x, y, key)
        return loss, Staged(grads, code.params)

    return run


def train_step(code: StageCode, schedule: Schedule, layout: Layout, mesh: Mesh,
               opts: StageOptimizers, example: Any, targets: Any) -> Callable:
    """`(state, batch) -> (state, metrics)`: the table, then each stage's update."""
    M, updates = schedule.microbatches, opts.update_branches()

    def body(p, s, x, y, key):
        out = _pass(code, schedule, layout, local(p), (), x, y, key)
        p, s = lax.switch(stage_index(), updates, local(p), out.grads, local(s))
        return lead(p), lead(s), out.losses, out.done

    sharded = shard(body, mesh, (STAGED, STAGED, REPLICATED, REPLICATED, REPLICATED),
                    (STAGED, STAGED, REPLICATED, REPLICATED))

    def step(state: TrainState, batch: tuple):
        x, y = microbatch.split(batch, M, example, targets)
        key = jax.random.fold_in(state.key, state.step)
        p, s, losses, done = sharded(state.params.buffers, state.opt_state.buffers, x, y, key)
        new = TrainState(Staged(p, code.params), Staged(s, opts.packing), state.step + 1,
                         state.key, None)
        ids = state.step * M + jnp.arange(M)
        return new, metrics(losses, done, ids)

    return step


def flush(state: TrainState) -> tuple[TrainState, dict]:
    """A synchronous pipeline holds nothing in flight: the state, no metrics."""
    empty = jnp.zeros(0, jnp.float32)
    return state, metrics(empty, jnp.zeros(0, bool), jnp.zeros(0, jnp.int32))
