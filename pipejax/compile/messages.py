"""Ring slots and the messages between devices, for the table interpreter.

What a device holds for micro-batch g on its chunk c (its input, the
output's gradient, kept residuals, the B→W bridge) lives in ring slot
`(g·v + c) mod capacity`, the capacities derived from the table
(schedules/capacities.py). `reads` names the slots an op reads; `exchange`
sends activations to the next virtual stage and gradients to the one before
with `lax.ppermute`, outside the stage switch, between the devices that
hold chunks j and j + 1 (`Placement.forward_pairs`). A
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
    return tuple(b.at[i].set(jnp.where(valid, v, b[i])) for b, v in zip(buffers, value))


def reads(rings: Rings, layout: Layout, op: Op, ring: jax.Array) -> tuple:
    """The ring slots `op` reads for ring id g·v + c: its input (and,
    backward, the output's gradient; W its input, its kept residuals and
    what its B filed)."""
    h = read(rings.inputs, ring % layout.input_slots)
    if op == Op.W:
        return (h, read(rings.kept, ring % layout.kept_slots),
                read(rings.bridge, ring % layout.bridge_slots))
    return (h,) if op == Op.F else (h, read(rings.grads, ring % layout.grad_slots))


class Message(NamedTuple):
    """What an op sends: its payload (packed activations or gradients) and
    the task that made it (its micro-batch g, virtual stage j, whether it ran)."""

    payload: Buffers
    task: TickTask


def exchange(rings: Rings, layout: Layout, placement: Placement, k: jax.Array,
             forward: Message, back: Message) -> Rings:
    """Inside shard_map, on device k: send `forward` on and `back` back;
    file what arrives."""
    if placement.stages == 1:
        return rings
    S = placement.chunks
    (msg_f, tf), (msg_b, tb) = forward, back
    on = placement.forward_pairs()
    # The receiver files a message under its own chunk: j + 1's (forward), j − 1's (back).
    got_f, gf, cf, vf = lax.ppermute(
        (msg_f, tf.g, placement.next_local(tf.j, k), tf.real & (tf.j < S - 1)), AXIS, on)
    got_b, gb, cb, vb = lax.ppermute(
        (msg_b, tb.g, placement.previous_local(tb.j, k), tb.real & (tb.j > 0)), AXIS,
        [(j, i) for i, j in on])
    return rings._replace(
        inputs=_file(rings.inputs, placement.ring(gf, cf) % layout.input_slots, got_f, vf),
        grads=_file(rings.grads, placement.ring(gb, cb) % layout.grad_slots, got_b, vb))


