"""The asynchronous programs: a step that feeds M micro-batches, and the flush.

PipeDream and pipelined backpropagation never drain (DESIGN.md): their table
is one period of the steady state. A step writes its batch into the data
rings (slot `id mod capacity`) and runs one period with micro-batch ids
base + relative id; each stage updates its weights right after each backward,
inside the scan, and what is still in flight stays in the state (`InFlight`).
Ops on ids not fed yet (the first fill) or before `start` are masked, so the
fill, the steady state and the drain are one compiled program, the same from
the first step on. `flush` runs periods with no new input until nothing is in
flight. Dropout keys: micro-batch g uses fold_in(state.key, g) at its forward
and at its backward (with R > 1 replicas: fold_in(fold_in(state.key, r), g)).

On a mesh with data axes every replica runs its own pipeline on its part of
each batch, in step: the same micro-batch ids at the same ticks, so after
each backward the replicas of a stage meet in their data rule (SSGD by
default: the update of every micro-batch uses its gradient over the whole
batch's share of it). A step's losses are the replicas' mean per micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from pipejax.compile import microbatch
from pipejax.compile.layout import Layout
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.compile.spmd import REPLICATED, lead, local, per_replica, replica_key, shard
from pipejax.compile.stages import StageCode
from pipejax.compile.state import InFlight, Staged, TrainState
from pipejax.compile.table import finishing, metrics, run_table
from pipejax.mesh import data_axes, replicas
from pipejax.schedules import Schedule


def init_inflight(layout: Layout, x_m: Any, y_m: Any, R: int = 1) -> InFlight:
    """An empty pipeline on each of R replicas: zero rings, nothing fed;
    `x_m`, `y_m` one micro-batch."""
    n = R * layout.stages
    ring = lambda s: jnp.zeros((n, layout.data_slots, *s.shape), s.dtype)
    zero = jnp.zeros((), jnp.int32)
    return InFlight(layout.rings((n,)), jax.tree.map(ring, x_m), jax.tree.map(ring, y_m),
                    zero, zero, zero)


def _periods(code: StageCode, schedule: Schedule, layout: Layout, mesh: Mesh,
             opts: StageOptimizers, n: int) -> Callable:
    """The SPMD program that runs `n` periods of the table from an `InFlight`;
    returns the new params, optimizer state and rings, and the [n·M] losses."""
    M, axes = schedule.microbatches, data_axes(mesh)

    def body(p, s, rule, rings, x, y, base, start, fed, key):
        if n == 0:  # nothing outlives its own period (one stage): no program to run
            return (p, s, rule, rings, jnp.zeros(0, jnp.float32), jnp.zeros(0, bool),
                    opts.consensus(local(p)), jnp.int32(0))
        key = replica_key(key, mesh)

        def period(i, c):
            p, s, rings, losses, done, skipped = c
            out = run_table(code, schedule, layout, p, s, rings, (local(x), local(y)),
                            (base + i * M, start, fed), key, opts, axes)
            losses = lax.dynamic_update_slice(losses, out.losses, (i * M,))
            done = lax.dynamic_update_slice(done, out.done, (i * M,))
            return out.params, out.opt_state, out.rings, losses, done, skipped + out.skipped

        state = OptState(local(s), local(rule))
        state = state._replace(ahead=opts.ahead(local(p), state))
        init = (local(p), state, local(rings),
                jnp.zeros(n * M, jnp.float32), jnp.zeros(n * M, bool), jnp.int32(0))
        p, s, rings, losses, done, skipped = lax.fori_loop(0, n, period, init)
        return (lead(p), lead(s.stages), lead(s.rule), lead(rings), losses, done,
                opts.consensus(p), skipped)

    spec = per_replica(mesh)
    return shard(body, mesh, (spec,) * 6 + (REPLICATED,) * 4,
                 (spec,) * 4 + (REPLICATED,) * 4)


def _advance(code, schedule, layout, mesh, opts, n: int) -> Callable:
    """`(state, x rings, y rings, fed) -> (state, metrics)` after `n` periods."""
    M, program = schedule.microbatches, _periods(code, schedule, layout, mesh, opts, n)
    order = (np.arange(n)[:, None] * M + finishing(schedule)[None]).ravel()  # relative ids
    R = replicas(mesh)

    def run(state: TrainState, x: Any, y: Any, fed: jax.Array, start: jax.Array):
        f = state.inflight
        p, s, rule, rings, losses, done, spread, skipped = program(
            state.params.buffers, state.opt_state.buffers, state.rule_state, f.rings, x, y,
            f.base, start, fed, state.key)
        inflight = InFlight(rings, x, y, f.base + n * M, start, fed)
        new = state._replace(params=Staged(p, code.params, R),
                             opt_state=Staged(s, opts.packing, R), inflight=inflight,
                             rule_state=rule)
        return new, metrics(losses, done, f.base + order, spread,
                            skipped if opts.skip_nonfinite else None)

    return run


def train_step(code: StageCode, schedule: Schedule, layout: Layout, mesh: Mesh,
               opts: StageOptimizers, example: Any, targets: Any) -> Callable:
    """`(state, batch) -> (state, metrics)`: feed M micro-batches, run one period."""
    M, K, slots, R = schedule.microbatches, schedule.stages, layout.data_slots, replicas(mesh)
    advance = _advance(code, schedule, layout, mesh, opts, 1)

    def step(state: TrainState, batch: tuple):
        x, y = microbatch.split(batch, M, example, targets, R)
        f = state.inflight
        # replica r's part [M, mb, ...] goes to the data rings of its K stages
        every = lambda new: jnp.broadcast_to(new[:, None], (R, K, *new.shape[1:])).reshape(
            R * K, *new.shape[1:])
        write = lambda ring, new: lax.dynamic_update_slice_in_dim(
            ring, every(new), f.base % slots, axis=1)
        x, y = jax.tree.map(write, f.x, x), jax.tree.map(write, f.y, y)
        state, out = advance(state, x, y, f.base + M, f.start)
        return state._replace(step=state.step + 1), out

    return step


def flush(code: StageCode, schedule: Schedule, layout: Layout, mesh: Mesh,
          opts: StageOptimizers) -> Callable:
    """`state -> (state, metrics)`: finish every micro-batch in flight (their
    updates included); afterwards the pipeline is empty and refills."""
    advance = _advance(code, schedule, layout, mesh, opts, schedule.drain_periods)

    def run(state: TrainState):
        f = state.inflight
        state, out = advance(state, f.x, f.y, f.fed, f.start)
        end = state.inflight.base
        return state._replace(inflight=state.inflight._replace(start=end, fed=end)), out

    return run
