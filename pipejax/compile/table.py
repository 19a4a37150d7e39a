"""The table interpreter: one `lax.scan` over the ticks of a schedule.

At tick t, stage k runs the micro-batch of the table's forward lane, then
that of its backward lane (each a loop of 0 or 1 trips, masked when the
micro-batch does not exist), then all stages exchange activations forward
and gradients backward with `lax.ppermute`, outside the stage switch
(DESIGN.md: collectives never sit in a branch). A message carries
(payload, micro-batch, valid); the receiver files it in ring slot
`micro-batch mod capacity`. Synchronous tables accumulate gradients;
asynchronous ones apply the stage's optimizer right after every backward.
A stage whose optimizer forecasts its weights runs its forward on the
forecast its last update made (`OptState.ahead`, carried from tick to tick)
and its backward on a backward forecast, if it has a backward horizon.
The program does not grow with the number of micro-batches or ticks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax.compile.layout import Layout
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.compile.packing import Buffers
from pipejax.compile.spmd import run_if, stage_index
from pipejax.compile.stages import StageCode
from pipejax.compile.state import Rings
from pipejax.mesh import AXIS
from pipejax.schedules import NONE, Schedule


class TableOut(NamedTuple):
    """One pass over the table, seen from one device."""

    params: Buffers
    opt_state: OptState | tuple  # () for a pass without optimizers
    rings: Rings
    grads: Any  # accumulated packed gradients (synchronous tables), () otherwise
    losses: jax.Array  # [M] float32: each finished micro-batch's loss, mean over the replicas
    done: jax.Array  # [M] bool: which of them the pass finished
    skipped: jax.Array  # int32: updates the guard skipped (all stages and replicas)


def loss_ticks(schedule: Schedule) -> np.ndarray:
    """The ticks on which the last stage runs a forward, hence computes a
    micro-batch's loss, ordered by that micro-batch's id."""
    lane = schedule.fwd[:, -1]
    ticks = np.flatnonzero(lane != NONE)
    return ticks[np.argsort(lane[ticks], kind="stable")]


def finishing(schedule: Schedule) -> np.ndarray:
    """Relative ids of the M micro-batches whose loss one pass computes, in order."""
    return schedule.fwd[loss_ticks(schedule), -1]


def metrics(losses: jax.Array, done: jax.Array, ids: jax.Array,
            spread: jax.Array | None = None, skipped: jax.Array | None = None) -> dict:
    """The metrics of a step: mean loss of the finished micro-batches (NaN if
    none), their count, and each micro-batch's loss (NaN if not finished);
    under a decentralized data rule, the replicas' consensus distance; with
    the non-finite guard, the updates it skipped."""
    count = jnp.sum(done.astype(jnp.int32))
    total = jnp.sum(jnp.where(done, losses, 0.0))
    out = {"loss": jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan),
           "completed": count, "losses": jnp.where(done, losses, jnp.nan),
           "microbatch": ids.astype(jnp.int32)}
    if spread is not None:
        out["consensus_distance"] = spread
    if skipped is not None:
        out["skipped"] = skipped
    return out


def _read(buffers: Buffers, i: jax.Array) -> tuple:
    return tuple(b[i] for b in buffers)


def _file(buffers: Buffers, i: jax.Array, value: Sequence, valid: jax.Array) -> tuple:
    return tuple(b.at[i].set(jnp.where(valid, v, b[i])) for b, v in zip(buffers, value))


class _Tick:
    """The body of the scan: what stage k does at one tick."""

    def __init__(self, code: StageCode, schedule: Schedule, layout: Layout, data: tuple,
                 counters: tuple, key: jax.Array, opts: StageOptimizers | None):
        self.code, self.layout, self.opts = code, layout, opts
        self.K, self.sync = schedule.stages, schedule.synchronous
        self.k = stage_index()
        self.x, self.y = data
        self.base, self.start, self.fed = counters
        self.key = key
        self.forwards, self.backwards = code.forward_branches(), code.backward_branches()

    def _real(self, rel: jax.Array, g: jax.Array) -> jax.Array:
        """An op is real if the table names one and micro-batch g was fed."""
        return (rel != NONE) & (g >= self.start) & (g < self.fed)

    def _inputs(self, g: jax.Array) -> tuple:
        """(x_m, y_m, key) of micro-batch g."""
        slot = g % self.layout.data_slots
        pick = lambda ring: jax.tree.map(lambda a: a[slot], ring)
        return pick(self.x), pick(self.y), jax.random.fold_in(self.key, g)

    def __call__(self, carry: tuple, row: tuple) -> tuple:
        p, s, rings, acc = carry
        fwd, bwd = row
        rel_f, rel_b = fwd[self.k], bwd[self.k]
        gf, gb = self.base + rel_f, self.base + rel_b
        do_f, do_b = self._real(rel_f, gf), self._real(rel_b, gb)
        lay = self.layout
        # Read the slots into values of their own before any buffer is
        # written, so that XLA updates the ring buffers in place.
        h_f, h_b, g_b = lax.optimization_barrier((
            _read(rings.inputs, gf % lay.input_slots), _read(rings.inputs, gb % lay.input_slots),
            _read(rings.grads, gb % lay.grad_slots)))
        p, s, kept, weights, msg_f, loss = self._forward(do_f, gf, p, s, rings, h_f)
        p, s, acc, msg_b, skipped = self._backward(do_b, gb, p, s, acc, kept, weights, h_b, g_b)
        rings = self._exchange(rings._replace(kept=kept, weights=weights),
                               (msg_f, gf, do_f), (msg_b, gb, do_b))
        last = do_f & (self.k == self.K - 1)  # a micro-batch's loss, once, on the last stage
        return (p, s, rings, acc), (jnp.where(last, loss, 0.0), last.astype(jnp.int32), skipped)

    def _forward(self, do_f, gf, p, s, rings: Rings, h_f) -> tuple:
        """Stage k's forward of micro-batch gf at its weights (or their
        forecast): keeps its residuals (and with weight stashing the weights
        it used) in slot gf; returns p, s, the rings and the message on.

        The weights pass through the loop's carry, untouched: as an operand
        of the loop XLA would copy them at every tick (they live on into
        the backward), in the carry it updates them in place."""
        slot = gf % self.layout.kept_slots
        ahead = self.opts is not None and bool(s.ahead)  # the forward runs on the forecast

        def forward(args, c):
            w, kept, weights, _, _ = c
            msg, new_kept, loss = self.code.groups.switch(self.forwards, w, *args)
            kept = tuple(b.at[slot].set(v) for b, v in zip(kept, new_kept))
            weights = tuple(b.at[slot].set(v) for b, v in zip(weights, w))
            return w, kept, weights, msg, loss

        init = (s.ahead if ahead else p, rings.kept, rings.weights, self.code.acts.zeros(),
                jnp.zeros((), jnp.float32))
        w, kept, weights, msg, loss = run_if(do_f, forward, (h_f, *self._inputs(gf)), init)
        p, s = (p, s._replace(ahead=w)) if ahead else (w, s)
        return p, s, kept, weights, msg, loss

    def _backward(self, do_b, gb, p, s, acc, kept, weights, h_b, g_b) -> tuple:
        """Stage k's backward of micro-batch gb at the current weights (their
        backward forecast, or the stashed ones); then the gradient is summed
        or applied at once (for a collective update, after the loop of 0 or 1
        trips: its collectives run on every device at every tick). Also
        returns 1 if the guard skipped the update, else 0."""
        slot = gb % self.layout.kept_slots
        stashed = _read(weights, slot) if self.layout.weight_stashing else None
        collective = not self.sync and self.opts.collective

        def backward(args, c):
            p, s, acc, _, skipped = c
            w = stashed if stashed is not None else (
                p if self.opts is None else self.opts.backward_weights(p, s))
            grads, msg = self.code.groups.switch(self.backwards, w, *args)
            if self.sync:
                return p, s, tuple(a + d for a, d in zip(acc, grads)), msg, skipped
            if collective:
                return p, s, grads, msg, skipped
            p, s, skipped = self.opts.update(p, grads, s)
            return p, s, acc, msg, skipped

        args = (h_b, g_b, _read(kept, slot), *self._inputs(gb))
        init = (p, s, self.code.params.zeros() if collective else acc, self.code.acts.zeros(),
                jnp.int32(0))
        p, s, acc, msg, skipped = run_if(do_b, backward, args, init)
        if collective:
            p, s, skipped = self.opts.update(p, acc, s, when=do_b)
            acc = ()
        return p, s, acc, msg, skipped

    def _exchange(self, rings: Rings, fwd_msg: tuple, bwd_msg: tuple) -> Rings:
        """Send activations to stage k + 1 and gradients to stage k − 1; file
        what arrives in its ring slot if it is a real message."""
        K, k, lay = self.K, self.k, self.layout
        if K == 1:
            return rings
        (msg_f, gf, do_f), (msg_b, gb, do_b) = fwd_msg, bwd_msg
        got_f, mf, vf = lax.ppermute((msg_f, gf, do_f & (k < K - 1)), AXIS,
                                     [(i, i + 1) for i in range(K - 1)])
        got_b, mb, vb = lax.ppermute((msg_b, gb, do_b & (k > 0)), AXIS,
                                     [(i + 1, i) for i in range(K - 1)])
        return rings._replace(inputs=_file(rings.inputs, mf % lay.input_slots, got_f, vf),
                              grads=_file(rings.grads, mb % lay.grad_slots, got_b, vb))


def run_table(code: StageCode, schedule: Schedule, layout: Layout, params: Buffers, opt_state: Any,
              rings: Rings, data: tuple, counters: tuple, key: jax.Array,
              opts: StageOptimizers | None = None,
              replica_axes: tuple[str, ...] = ()) -> TableOut:
    """Inside shard_map: one pass over the table.

    `data` = (x, y) rings `[slots, mb, ...]`; `counters` = (base, start, fed):
    this pass's micro-batch ids are base + relative id, and an op is real only
    for start <= id < fed (the rest is the fill or the drain, masked).
    `opts` are the per-stage optimizers an asynchronous table applies.
    Losses are averaged over `replica_axes` (the mesh's data axes).
    """
    ticks = loss_ticks(schedule)  # static
    acc = code.params.zeros() if schedule.synchronous else ()
    xs = (jnp.asarray(schedule.fwd, jnp.int32), jnp.asarray(schedule.bwd, jnp.int32))
    tick = _Tick(code, schedule, layout, data, counters, key, opts)
    # Each tick emits its loss (0 unless the last stage finished a micro-batch);
    # the static `ticks` then pick the M losses of this pass in id order.
    (p, s, rings, acc), (losses, done, skipped) = lax.scan(tick, (params, opt_state, rings, acc),
                                                          xs)
    losses, done = lax.psum(losses, AXIS)[ticks], lax.psum(done, AXIS)[ticks] > 0
    guarded = opts is not None and opts.skip_nonfinite
    skipped = lax.psum(jnp.sum(skipped), (*replica_axes, AXIS)) if guarded else jnp.int32(0)
    if replica_axes:  # every replica finishes the same micro-batches
        losses = lax.pmean(losses, replica_axes)
    return TableOut(p, s, rings, acc, losses, done, skipped)
