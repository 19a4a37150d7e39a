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
message carries (payload, micro-batch, chunk, valid); the receiver files a
valid one in its slot.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.compile.lanes import TickTask
from pipejax.compile.layout import Layout
from pipejax.packing import Buffers
from pipejax.compile.state import Rings
from pipejax.mesh import AXIS
from pipejax.placement import Placement
from pipejax.schedules import Op


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


class Message(NamedTuple):
    """What an op sends: its payload (packed activations or gradients) and
    the task that made it (its micro-batch g, virtual stage j, whether it ran)."""

    payload: Buffers
    task: TickTask


def either(a: Message, b: Message) -> Message:
    """The message of whichever of two ops ran (a cell runs at most one
    op that sends a gradient back: B or BW)."""
    pick = lambda x, y: jnp.where(a.task.real, x, y)
    return Message(jax.tree.map(pick, a.payload, b.payload),
                   TickTask(*map(pick, a.task, b.task)))


def _send(placement: Placement, k: jax.Array, message: Message, step: int) -> list[tuple]:
    """`message` from chunk j to chunk j + `step`, along each of the
    placement's routes (a `lax.ppermute`, or none for a message that stays
    on its device): what each route delivers to this device, as (payload,
    micro-batch, the receiver's local chunk, valid)."""
    payload, task = message
    target = task.j + step
    local = (placement.next_local(task.j, k) if step > 0 else
             placement.previous_local(task.j, k))
    valid = task.real & (target >= 0) & (target < placement.chunks)
    routes = placement.routes(step)
    got = []
    for route in routes:
        on = valid if len(routes) == 1 else valid & (
            (placement.device(target) - k) % placement.stages == route.shift)
        sent = (payload, task.g, local, on)
        got.append(sent if route.shift == 0 else lax.ppermute(sent, AXIS, route.pairs))
    return got


def exchange(rings: Rings, layout: Layout, placement: Placement, k: jax.Array,
             forward: Message, back: Message) -> Rings:
    """Inside shard_map, on device k: send `forward` on and `back` back;
    file what arrives, under the receiver's own chunk (j + 1's, j − 1's)."""
    if placement.chunks == 1:  # one device, one chunk: no message
        return rings
    inputs, grads = rings.inputs, rings.grads
    for payload, g, c, valid in _send(placement, k, forward, 1):
        inputs = _file(inputs, placement.ring(g, c) % layout.input_slots, payload, valid)
    for payload, g, c, valid in _send(placement, k, back, -1):
        grads = _file(grads, placement.ring(g, c) % layout.grad_slots, payload, valid)
    return rings._replace(inputs=inputs, grads=grads)
