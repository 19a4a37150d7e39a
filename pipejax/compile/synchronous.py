"""The synchronous programs: `value_and_grad` and the training step.

A synchronous table (GPipe, 1F1B) runs M micro-batches from an empty pipeline
to an empty one in one pass; the gradients of the micro-batches' mean loss
are accumulated and each stage applies one update on its own device (GPipe
§2), so a step equals the sequential computation on the whole batch. Dropout
keys: step key fold_in(state.key, step), micro-batch m fold_in(., m), layer i
fold_in(., i), as a sequential run derives them.

On a mesh with data axes each replica runs the table on its part of the
batch (`[R·M·mb]` split replica-major); `value_and_grad` averages the
gradients over the replicas (the whole batch's gradient), a trainer hands
them to its data rule. With R > 1 replicas, replica r draws its dropout
keys from fold_in(step key, r); on stages sharded over F devices, device f
of replica r from fold_in(step key, r·F + f).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.compile import microbatch
from pipejax.compile.build import Build
from pipejax.compile.lanes import Counters
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.compile.spmd import (REPLICATED, in_place, lead, local, params, per_device,
                                  replica_key, shard, split_batch)
from pipejax.compile.state import Rings, Staged, TrainState
from pipejax.compile.metrics import metrics
from pipejax.compile.table import run_table
from pipejax.compile.table_state import TableIn, TableOut
from pipejax.compile.ties import equal, summed


def scratch(build: Build) -> Rings:
    """The ring buffers a synchronous trainer carries from step to step
    (`TrainState.scratch`), a row per device: zeros, never read before a
    step writes them."""
    return build.layout.rings((build.rows,))


def _pass(build: Build, p: Any, batch: tuple, key: jax.Array, rings: Rings | None = None
          ) -> TableOut:
    """Inside shard_map: the table once over this replica's batch `[1, M, mb, ...]`,
    on `rings` (this device's, carried from the last step) or on new ones."""
    counters = Counters(jnp.int32(0), jnp.int32(0), jnp.int32(build.M))
    x, y = batch
    rings = build.layout.rings(empty=True) if rings is None else rings
    inp = TableIn(p, (), rings, (local(x), local(y)), counters, replica_key(key, build.mesh))
    return run_table(build, inp)


def value_and_grad(build: Build) -> Callable:
    """`(params, batch, key) -> (mean loss over the micro-batches, its gradient)`."""
    axes = build.axes

    def body(p, x, y, key):
        out = _pass(build, local(p), (x, y), key)
        grads = summed(build.code.params, out.grads, build.F)
        grads = lax.pmean(grads, axes) if axes else grads
        return jnp.mean(out.losses), lead(grads)

    batch, staged = split_batch(build.mesh), params(build.mesh, replicas=False)
    sharded = shard(body, build.mesh, (staged, batch, batch, REPLICATED), (REPLICATED, staged))

    def run(p: Staged, batch: tuple, key: jax.Array):
        x, y = microbatch.divide(batch, build.M, build.example, build.targets, build.R, build.F)
        loss, grads = sharded(p.buffers, x, y, key)
        return loss, Staged(grads, build.code.params)

    return run


def train_step(build: Build, opts: StageOptimizers, carried: bool = True) -> Callable:
    """`(state, batch) -> (state, metrics)`: the table, then each stage's
    update; on the state's rings, or (`carried=False`: a build at another
    shape than the state's rings, compile/shapes.py) on new ones, the
    state's passed through."""
    M, R, outer = build.M, build.R, opts.outer
    # The guard decides for the whole step on every device alike.
    update = opts.updater(scope=tuple(build.mesh.axis_names))

    def body(state, x, y, key):
        p, s, rule, rings = state
        out = _pass(build, local(p), (x, y), key, local(rings) if carried else None)
        finite = jnp.all(jnp.isfinite(out.losses)) if outer.skip_nonfinite else None

        def apply(p, grads, s, rule):
            p, s, skipped = update(p, grads, OptState(s, rule), finite)
            return p, s.stages, s.rule, skipped

        grads = lead(summed(build.code.params, out.grads, build.F))
        p, s, rule, skipped = in_place(apply)(p, grads, s, rule)
        p = lead(equal(build.code.params, local(p), build.F))
        skipped = None if finite is None else jnp.maximum(skipped[0], (~finite).astype(jnp.int32))
        rings = lead(out.rings) if carried else rings
        return p, s, rule, rings, out.losses, out.done, outer.consensus(local(p)), skipped

    rows, device, batch = params(build.mesh), per_device(build.mesh), split_batch(build.mesh)
    sharded = shard(body, build.mesh, ((rows, device, device, device), batch, batch, REPLICATED),
                    (rows, device, device, device) + (REPLICATED,) * 4)

    def step(state: TrainState, batch: tuple):
        x, y = microbatch.divide(batch, M, build.example, build.targets, R, build.F)
        key = jax.random.fold_in(state.key, state.step)
        p, s, rule, rings, losses, done, spread, skipped = sharded(
            (state.params.buffers, state.opt_state.buffers, state.rule_state, state.scratch), x,
            y, key)
        new = TrainState(Staged(p, build.code.params), Staged(s, opts.packing),
                         state.step + 1, state.key, None, rule, rings)
        ids = state.step * M + jnp.arange(M)
        return new, metrics(losses, done, ids, spread, skipped)

    return step


def flush(state: TrainState) -> tuple[TrainState, dict]:
    """A synchronous pipeline holds nothing in flight: the state, no metrics."""
    empty = jnp.zeros(0, jnp.float32)
    return state, metrics(empty, jnp.zeros(0, bool), jnp.zeros(0, jnp.int32))
