"""PipeDream-2BW's two weight versions (Narayanan et al. 2021, "Memory-
Efficient Pipeline-Parallel DNN Training", §3.1).

A double-buffered table (`Schedule.double_buffered`) runs every op of the
micro-batches of step j, forward and backward, on the version W(j − 1), and
each stage updates once a step, at the backward of the step's last
micro-batch, with the mean of the step's M gradients:

    W(j + 1) = W(j) + u(∇f(W(j − 1)))        (2BW's W(t+1) = W(t) − ν·∇f(W(t−1)))

u the stage's optimizer; one step of delay at every stage, whatever K, and
two versions a stage where PipeDream's weight stashing keeps one per
micro-batch in flight. A stage's live weights p are W(v), the newest (the
optimizer updates them); `Versions` holds W(v − 1), the step's gradient sum
so far and v. An op of step j runs on p where v = j − 1 (step j − 1 has not
updated this stage yet) and on W(v − 1) where v = j; the table guarantees
nothing else occurs (`schedules.checks.check_versions`). Residuals kept
from the forward were computed on the version the backward uses, so remat
"none" is exact. The versions travel with the rings (the in-flight state,
carried through every op's loop); a pass that starts on an empty pipeline
(the first step, a step after a flush) starts them from W(−1) = W(0).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pipejax.compile.spmd import run_if
from pipejax.packing import Buffers, Packing


class Versions(NamedTuple):
    """One device's versions beside its live weights W(v)."""

    previous: Buffers  # W(v − 1), packed as the live weights
    accumulated: Buffers  # the sum of this step's gradients so far (seeded 1/M: the mean)
    latest: jax.Array  # int32: v


def zeros(pieces: Packing, lead: tuple[int, ...] = ()) -> Versions:
    """Versions of zeros, `lead` devices of them; `restart` fills them."""
    return Versions(pieces.zeros(lead), pieces.zeros(lead), jnp.zeros(lead, jnp.int32))


def restart(v: Versions, p: Buffers, base: jax.Array, start: jax.Array, M: int) -> Versions:
    """At the start of a pass whose first id is `base`: unchanged where
    micro-batches are in flight; on an empty pipeline (`base == start`)
    W(−1) = W(0) = p, no gradient, v = the step before this one."""
    empty = base == start
    pick = lambda fresh, kept: tuple(jnp.where(empty, a, b) for a, b in zip(fresh, kept))
    return Versions(pick(p, v.previous),
                    pick(tuple(jnp.zeros_like(a) for a in v.accumulated), v.accumulated),
                    jnp.where(empty, base // M - 1, v.latest))


def weights(p: Buffers, v: Versions, g: jax.Array, M: int) -> Buffers:
    """The version micro-batch g's ops run on: W(j − 1), j = g // M."""
    behind = v.latest >= g // M
    return tuple(jnp.where(behind, a, b) for a, b in zip(v.previous, p))


def add(v: Versions, grads: Buffers) -> Versions:
    """Micro-batch's `grads` added to its step's sum."""
    return v._replace(accumulated=tuple(a + b for a, b in zip(v.accumulated, grads)))


def _closed(p: Buffers, v: Versions, g: jax.Array, M: int) -> Versions:
    """The versions after micro-batch g's step updates live weights `p`:
    `p` the previous, no gradient, the next step's version."""
    return Versions(p, tuple(jnp.zeros_like(a) for a in v.accumulated), g // M + 1)


def take(update: Callable, M: int, c: tuple, grads: Buffers, g: jax.Array) -> tuple:
    """Inside a backward's loop, `c` = (p, s, versions, skipped): add
    micro-batch g's gradient to its step's sum; at the step's last
    micro-batch update the live weights with it (`update(p, grads, s) ->
    (p, s, skipped)`) and keep the old ones as the previous version."""
    p, s, v, skipped = c

    def close(_, c):
        p, s, v, skipped = c
        new, s, skip = update(p, v.accumulated, s)
        return new, s, _closed(p, v, g, M), skipped + skip

    return run_if(g % M == M - 1, close, (), (p, s, add(v, grads), skipped))


def take_after(update: Callable, M: int, c: tuple, g: jax.Array, real: jax.Array) -> tuple:
    """After a backward's loop, on every device at every tick (an update
    whose data rule or clip runs collectives), `c` = (p, s, versions): the
    update of `take`, masked where the tick's backward is not the last of a
    real step (`update(p, grads, s, when)` masks its own result). The clip's
    global norm is then over the stages that update at that tick, as under
    the other asynchronous tables: on PipeDream's ticks no two stages end a
    step at one tick, so each stage's step is clipped by its own norm.
    Returns (p, s, versions, skipped)."""
    p, s, v = c
    when = real & (g % M == M - 1)
    closed = _closed(p, v, g, M)
    # A stage whose step goes on adds nothing to the collectives (the clip's norm).
    new, s, skipped = update(p, tuple(jnp.where(when, a, 0) for a in v.accumulated), s, when)
    return new, s, jax.tree.map(lambda a, b: jnp.where(when, a, b), closed, v), skipped
