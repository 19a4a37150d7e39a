"""An op's loop in a tick: 0 or 1 trips, carrying the rings and the tick's
messages, so that XLA updates both in place and sends after the last op.

Each op of a tick (table.py, split_ops.py) runs in a loop of 0 or 1 trips
(`spmd.run_if`, masked where the op is idle) that carries what every op
hands on: the rings, which it reads and writes inside, and the tick's
messages (`Ops.mail`), the one it writes or not. The exchange then files
the messages into what the last loop returned and sends them.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from pipejax.compile import messages
from pipejax.compile.layout import Layout
from pipejax.compile.lanes import TickTask
from pipejax.compile.rendezvous import varying
from pipejax.compile.spmd import run_if
from pipejax.compile.table_state import Ops
from pipejax.schedules import Op


class OpLoops:
    """The loops of a tick's ops, over the rings of `layout`; none where
    every op runs at every tick (`busy`)."""

    def __init__(self, layout: Layout, busy: bool):
        self.layout, self.busy = layout, busy

    def run(self, op: Op, task: TickTask, fn: Any, operands: Any, carry: Any,
            ops: Ops) -> tuple[Any, Ops]:
        """`fn(operands, carry, rings, mail, slots) -> (carry, rings, mail)`
        in the loop of `op`'s task, with the rings and the tick's messages
        (`ops.mail`, `messages.letter`) in its carry and `slots` the rows of
        the rings the messages fill that `op` reads (`messages.reads`);
        `fn` itself, without a loop, when every op runs at every tick
        (`busy`).

        Every op's loop hands on the messages, so the sends follow the
        tick's last loop by data. Given to the exchange beside the loops,
        each message left right after the loop that wrote it (XLA's
        schedule: F's loop, F's send, BW's loop, BW's send), and a device
        whose op came after a send waited there for every other device's op
        before it: a tick took the sum of its devices' ops, not the most
        (1F1B at K = 2 on two cores, a core a device: one device computed
        alone 61 % of the step, 29 % with the sends last).

        Every op reads its slots inside its loop, from the rings it carries,
        and hands them on through an optimization barrier. The reads come
        before the writes by data, so XLA updates each ring in place: sliced
        before the loops (at every tick, for every op, run or not) the stage
        inputs' ring was copied twice a tick (1F1B, the zoo GPT at K = 4:
        2 MB a tick) and every kept residual read whether its backward ran
        or not. Without the barrier XLA copies a ring that a loop hands back
        unchanged (`_forward`'s stashed weights)."""
        def body(operands, c):
            carry, rings, mail = c
            slots = messages.reads(rings, self.layout, op, task.ring)
            carry, rings, mail = fn(operands, carry, rings, mail, slots)
            return (carry, *lax.optimization_barrier((rings, mail)))

        state = (carry, ops.rings, ops.mail)
        if self.busy:
            carry, rings, mail = body(operands, state)
        else:
            with varying():  # whether a stage runs the op this tick
                carry, rings, mail = run_if(task.real, body, operands, state)
        return carry, ops._replace(rings=rings, mail=mail)
