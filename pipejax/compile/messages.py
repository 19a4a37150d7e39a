"""Ring slots and the messages between devices, for the table interpreter.

What a device holds for micro-batch g on its chunk c (its input, the
output's gradient, kept residuals, the B→W bridge) lives in ring slot
`(g·v + c) mod capacity`, the capacities derived from the table
(schedules/capacities.py). `reads` names the slots an op reads of the rings
the messages fill (inputs, gradients; the executor reads the others where
the op runs); `exchange`
sends activations to the next virtual stage and gradients to the one before
with `lax.ppermute`, outside the stage switch, between the devices that
hold chunks j and j + 1, along the placement's routes (`Placement.routes`:
the ring for a loop; down, up and the turn on one device for a V). A
message carries its payload; the receiver reads off the table which task
sent it (micro-batch, chunk, whether it ran) and files a valid one in its
slot: a buffer the ops share (`letter`) is filed as an input or a
gradient as the sender's forward or backward ran. A collective runs only
at the ticks where the table sends something along its pairs (`carried`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pipejax.compile.lanes import TickTask
from pipejax.compile.layout import Layout
from pipejax.packing import Buffers
from pipejax.compile.state import Rings
from pipejax.mesh import STAGE
from pipejax.placement import Placement
from pipejax.schedules import NONE, Op, Schedule
from pipejax.schedules.tasks import BACKWARD


def read(buffers: Buffers, i: jax.Array) -> tuple:
    """Slot i of each buffer."""
    return tuple(b[i] for b in buffers)


def _file(buffers: Buffers, i: jax.Array, value: Sequence, valid: jax.Array) -> tuple:
    """`value` written into slot i of each buffer if `valid`: an invalid
    message goes past the end and is dropped, so the slot is never read
    to be written back (a read-modify-write made XLA copy a message)."""
    at = lambda b: jnp.where(valid, i, b.shape[0])
    return tuple(b.at[at(b)].set(v, mode="drop") for b, v in zip(buffers, value))


def reads(rings: Rings, layout: Layout, op: Op, ring: jax.Array) -> tuple:
    """The slots of the rings the messages fill that `op` reads for ring id
    g·v + c: its input and, backward (BW, B), the output's gradient. The
    rings the ops fill themselves (kept residuals, the bridge) are read
    where the op runs, after the tick's earlier ops wrote theirs."""
    h = read(rings.inputs, ring % layout.input_slots)
    return (h,) if op in (Op.F, Op.W) else (h, read(rings.grads, ring % layout.grad_slots))


def either(a: TickTask, b: TickTask) -> TickTask:
    """The task of whichever of two ops ran (a cell runs at most one op
    that sends a gradient back: B or BW)."""
    return TickTask(*(jnp.where(a.real, x, y) for x, y in zip(a, b)))


def _deliver(placement: Placement, sender: jax.Array, task: TickTask, step: int,
             shift: int | None) -> tuple:
    """(micro-batch, the receiver's local chunk, valid) of the message that
    device `sender`'s `task` sends from chunk j to chunk j + `step` along
    the route of device shift `shift` (None: the placement's only route)."""
    target = task.j + step
    local = (placement.next_local(task.j, sender) if step > 0 else
             placement.previous_local(task.j, sender))
    valid = task.real & (target >= 0) & (target < placement.chunks)
    if shift is not None:
        valid = valid & (placement.shift(task.j, step) == shift)
    return task.g, local, valid


def _send(placement: Placement, k: jax.Array, step: int,
          sent_by: Callable[[jax.Array], TickTask]) -> list[tuple]:
    """The routes of the placement for messages from chunk j to chunk j +
    `step`: per route, (its pairs, None for the one that stays on its
    device; and what it delivers to device k: micro-batch, k's local
    chunk, valid). Only the payload travels: which task sent it, and so
    where it is filed, the receiver reads off the table (`sent_by(device)`),
    every device holding the whole table; a ppermute of the three scalars
    cost a collective each, at every tick."""
    routes = placement.routes(step)
    got = []
    for route in routes:
        shift = None if len(routes) == 1 else route.shift
        if route.shift == 0:
            got.append((None, _deliver(placement, k, sent_by(k), step, shift)))
            continue
        sender = (k - route.shift) % placement.stages
        receives = jnp.asarray([any(dst == d for _, dst in route.pairs)
                                for d in range(placement.stages)])[k]
        g, local, valid = _deliver(placement, sender, sent_by(sender), step, shift)
        got.append((tuple(route.pairs), (g, local, valid & receives)))
    return got


def collectives(placement: Placement) -> list[tuple]:
    """The pairs of each collective a tick can run: the placement's routes
    on and back that leave their device, those with equal pairs once (a
    V's activations down and its gradients up share (k, k + 1))."""
    pairs = [tuple(route.pairs) for step in (1, -1) for route in placement.routes(step)
             if route.shift != 0]
    return list(dict.fromkeys(pairs))


def carried(schedule: Schedule) -> np.ndarray:
    """`[ticks, len(collectives)]`: whether some device's forward or
    backward (B, BW) at tick t sends a message along that collective's
    pairs, read off the table (so every device runs the same collectives).
    A collective costs a rendezvous of the devices whatever it carries, on
    simulated CPU devices most of a tick's fixed cost (`table_speed.py
    --group tiny-4`), and 10 of 1F1B's 22 ticks and 26 of zb-v's 51 send
    one way only (K = 4, M = 8)."""
    placement = schedule.placement
    K, S = placement.stages, placement.chunks
    index = collectives(placement)
    out = np.zeros((schedule.ticks, len(index)), bool)
    k = np.arange(K)
    for step, ops in ((1, (Op.F,)), (-1, BACKWARD)):
        j = placement.chunk(k, schedule.cells(ops, 2))
        sends = (schedule.cells(ops) != NONE) & (j + step >= 0) & (j + step < S)
        shift = placement.shift(j, step)
        for route in placement.routes(step):
            if route.shift != 0:
                out[:, index.index(tuple(route.pairs))] |= (sends & (shift == route.shift)).any(1)
    return out


def buffers(schedule: Schedule) -> np.ndarray:
    """Per collective (`collectives`), the message buffers it sends: one
    for each way (on, back) with a route along its pairs (a V's down and
    up carry both ways), but one in all where the ops share a buffer
    (`Schedule.messages`), which travels once."""
    placement = schedule.placement
    ways = [{tuple(r.pairs) for r in placement.routes(step) if r.shift != 0} for step in (1, -1)]
    return np.array([min(schedule.messages, sum(pairs in way for way in ways))
                     for pairs in collectives(placement)], np.int64)


def _moved(sends: list[tuple[tuple | None, Buffers]], busy: jax.Array,
           placement: Placement) -> list[Buffers]:
    """Each (pairs, payload) moved by `lax.ppermute` along its pairs (None:
    it stays), where this tick's row of `carried` (`busy`) says the table
    sends along them; elsewhere zeros arrive, which no receiver files. The
    leaves of one dtype that travel along equal pairs go in one buffer, one
    collective: a V's activations down and its gradients up share the
    pairs (k, k + 1), as do the other two ways; with a collective each, a
    tick of zb-v ran four. A leaf that two payloads share (one message
    buffer, `letter`) travels once."""
    index = collectives(placement)
    permute = lambda x, pairs: lax.cond(busy[index.index(pairs)],
                                        lambda x: lax.ppermute(x, STAGE, pairs), jnp.zeros_like, x)
    out = [list(payload) for _, payload in sends]
    together: dict[tuple, list] = {}
    for i, (pairs, payload) in enumerate(sends):
        for n, leaf in enumerate(payload if pairs is not None else ()):
            together.setdefault((pairs, leaf.dtype), []).append((i, n, leaf))
    for (pairs, _), leaves in together.items():
        unique = list({id(leaf): leaf for *_, leaf in leaves}.values())
        if len(unique) == 1:
            moved = [permute(unique[0], pairs)]
        else:
            flat = permute(jnp.concatenate([u.ravel() for u in unique]), pairs)
            ends = np.cumsum([0] + [u.size for u in unique])
            moved = [flat[a:b].reshape(u.shape) for a, b, u in zip(ends, ends[1:], unique)]
        by_id = {id(u): m for u, m in zip(unique, moved)}
        for i, n, leaf in leaves:
            out[i][n] = by_id[id(leaf)]
    return [tuple(payload) for payload in out]


def letter(mail: tuple, way: int) -> Buffers:
    """The tick's message `way` (0: on, 1: back) in `mail`, the buffers the
    ops write and the exchange sends: one buffer serves both where no
    device runs a forward and a backward at one tick (`Schedule.messages`)."""
    return mail[_box(mail, way)]


def posted(mail: tuple, way: int, message: Buffers) -> tuple:
    """`mail` with `message` written as its message `way`."""
    return tuple(message if i == _box(mail, way) else m for i, m in enumerate(mail))


def _box(mail: tuple, way: int) -> int:
    """The buffer of `mail` that holds message `way`."""
    return min(way, len(mail) - 1)


class Sends(NamedTuple):
    """What the table sends at a tick: `sent_by(device)`, the (forward,
    backward) tasks whose messages that device sends; `busy`, the tick's
    row of `carried`, which collectives carry one."""

    sent_by: Callable[[jax.Array], tuple[TickTask, TickTask]]
    busy: jax.Array


def exchange(rings: Rings, layout: Layout, placement: Placement, k: jax.Array, mail: tuple,
             sends: Sends) -> Rings:
    """Inside shard_map, on device k: send the forward's message on and the
    backward's back (`mail`, `letter`) as the table says (`sends`); file
    what arrives, under the receiver's own chunk (j + 1's, j − 1's)."""
    if placement.chunks == 1:  # one device, one chunk: no message
        return rings
    ways = [(letter(mail, 0), 1, lambda d: sends.sent_by(d)[0]),
            (letter(mail, 1), -1, lambda d: sends.sent_by(d)[1])]
    routes = [[(pairs, payload, where) for pairs, where in _send(placement, k, step, by)]
              for payload, step, by in ways]
    moved = iter(_moved([(pairs, payload) for way in routes for pairs, payload, _ in way],
                        sends.busy, placement))
    (forward, back), (inputs, grads) = routes, (rings.inputs, rings.grads)
    for _, _, (g, c, valid) in forward:
        inputs = _file(inputs, placement.ring(g, c) % layout.input_slots, next(moved), valid)
    for _, _, (g, c, valid) in back:
        grads = _file(grads, placement.ring(g, c) % layout.grad_slots, next(moved), valid)
    return rings._replace(inputs=inputs, grads=grads)
