"""The asynchronous programs: a step that feeds M micro-batches, and the flush.

PipeDream and pipelined backpropagation never drain: their table
is one period of the steady state. A step writes its batch into the data
rings (slot `id mod capacity`) and runs one period with micro-batch ids
base + relative id; each stage updates its weights right after each backward,
inside the scan (a double-buffered table once a step, compile/versions.py),
and what is still in flight stays in the state (`InFlight`).
Ops on ids not fed yet (the first fill) or before `start` are masked, so the
fill, the steady state and the drain are one compiled program, the same from
the first step on. `flush` runs periods with no new input until nothing is in
flight. Dropout keys: micro-batch g uses fold_in(state.key, g) at its forward
and at its backward (with R > 1 replicas: fold_in(fold_in(state.key, r), g);
on stages sharded over F devices, r·F + f for device f's part).

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

from pipejax.compile import microbatch, versions
from pipejax.compile.build import Build
from pipejax.compile.lanes import Counters
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.compile.spmd import REPLICATED, lead, local, params, per_device, replica_key, shard
from pipejax.compile.state import InFlight, Staged, TrainState
from pipejax.compile.metrics import finishing, metrics
from pipejax.compile.table import run_table
from pipejax.compile.table_state import TableIn


def init_inflight(build: Build) -> InFlight:
    """An empty pipeline on each of the R replicas: zero rings, nothing fed
    (a row per device: `[R·K·F, ...]`)."""
    layout, n = build.layout, build.rows
    ring = lambda s: jnp.zeros((n, layout.data_slots, *s.shape), s.dtype)
    zero = jnp.zeros((), jnp.int32)
    return InFlight(layout.rings((n,)), jax.tree.map(ring, build.example),
                    jax.tree.map(ring, build.targets), zero, zero, zero)


def _periods(build: Build, opts: StageOptimizers, n: int) -> Callable:
    """The SPMD program that runs `n` periods of the table from an `InFlight`:
    `((p, s, rule), rings, (x, y), (base, start, fed), key)` -> the new
    params, optimizer state, rule state and rings, the [n·M] losses and
    which finished, the consensus distance and the skipped updates."""
    M, outer = build.M, opts.outer

    def body(trained, rings, data, counters, key):
        (p, s, rule), (x, y) = trained, data
        if n == 0:  # nothing outlives its own period (one stage): no program to run
            return (p, s, rule, rings, jnp.zeros(0, jnp.float32), jnp.zeros(0, bool),
                    outer.consensus(local(p)), jnp.int32(0))
        base, start, fed = counters
        key = replica_key(key, build.mesh)

        def period(i, c):
            p, s, rings, losses, done, skipped = c
            if build.layout.versions:  # W(−1) = W(0) where the pipeline is empty
                rings = rings._replace(versions=versions.restart(rings.versions, p, base + i * M,
                                                                 start, M))
            out = run_table(build, TableIn(p, s, rings, (local(x), local(y)),
                                           Counters(base + i * M, start, fed), key), opts)
            losses = lax.dynamic_update_slice(losses, out.losses, (i * M,))
            done = lax.dynamic_update_slice(done, out.done, (i * M,))
            return out.params, out.opt_state, out.rings, losses, done, skipped + out.skipped

        state = OptState(local(s), local(rule))
        state = state._replace(ahead=opts.ahead(local(p), state))
        init = (local(p), state, local(rings),
                jnp.zeros(n * M, jnp.float32), jnp.zeros(n * M, bool), jnp.int32(0))
        p, s, rings, losses, done, skipped = lax.fori_loop(0, n, period, init)
        return (lead(p), lead(s.stages), lead(s.rule), lead(rings), losses, done,
                outer.consensus(p), skipped)

    rows, device = params(build.mesh), per_device(build.mesh)
    return shard(body, build.mesh, ((rows, device, device), device, (device,) * 2, REPLICATED,
                                    REPLICATED), (rows,) + (device,) * 3 + (REPLICATED,) * 4)


def _advance(build: Build, opts: StageOptimizers, n: int) -> Callable:
    """`(state, x rings, y rings, (fed, start)) -> (state, metrics)` after `n` periods."""
    M, program = build.M, _periods(build, opts, n)
    order = (np.arange(n)[:, None] * M + finishing(build.schedule)[None]).ravel()  # relative ids

    def run(state: TrainState, x: Any, y: Any, fed: jax.Array, start: jax.Array):
        f = state.inflight
        p, s, rule, rings, losses, done, spread, skipped = program(
            (state.params.buffers, state.opt_state.buffers, state.rule_state), f.rings, (x, y),
            (f.base, start, fed), state.key)
        inflight = InFlight(rings, x, y, f.base + n * M, start, fed)
        new = state._replace(params=Staged(p, build.code.params),
                             opt_state=Staged(s, opts.packing), inflight=inflight,
                             rule_state=rule)
        return new, metrics(losses, done, f.base + order, spread,
                            skipped if opts.outer.skip_nonfinite else None)

    return run


def train_step(build: Build, opts: StageOptimizers) -> Callable:
    """`(state, batch) -> (state, metrics)`: feed M micro-batches, run one period."""
    M, K, slots, R, F = build.M, build.K, build.layout.data_slots, build.R, build.F
    advance = _advance(build, opts, 1)

    def every(new: jax.Array) -> jax.Array:
        """Replica r's part `[M, mb, ...]` to the data rings of its K stages,
        part f of each micro-batch to their device f: `[R·K·F, M, mb / F, ...]`."""
        parts = jnp.moveaxis(new.reshape(R, M, F, -1, *new.shape[3:]), 2, 1)
        return jnp.broadcast_to(parts[:, None], (R, K, *parts.shape[1:])).reshape(
            R * K * F, *parts.shape[2:])

    def step(state: TrainState, batch: tuple):
        x, y = microbatch.divide(batch, M, build.example, build.targets, R, F)
        f = state.inflight
        write = lambda ring, new: lax.dynamic_update_slice_in_dim(
            ring, every(new), f.base % slots, axis=1)
        x, y = jax.tree.map(write, f.x, x), jax.tree.map(write, f.y, y)
        state, out = advance(state, x, y, f.base + M, f.start)
        return state._replace(step=state.step + 1), out

    return step


def flush(build: Build, opts: StageOptimizers) -> Callable:
    """`state -> (state, metrics)`: finish every micro-batch in flight (their
    updates included); afterwards the pipeline is empty and refills."""
    advance = _advance(build, opts, build.schedule.drain_periods)

    def run(state: TrainState):
        f = state.inflight
        state, out = advance(state, f.x, f.y, f.fed, f.start)
        end = state.inflight.base
        return state._replace(inflight=state.inflight._replace(start=end, fed=end)), out

    return run
