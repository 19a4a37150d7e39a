"""Zero bubble's B and W inside a tick (Qi et al. 2024, §2): the input
gradient of a micro-batch, sent back at once with what its W needs filed in
a bridge slot, and the weight gradient later from its kept residuals and
that bridge. The table interpreter's tick (table.py) runs them beside its
forward and fused backward; they read the tick's state (`Ops`) and its
context (`TickContext`: the stage's branches, its layout) as those do.
"""

from __future__ import annotations

from typing import Callable

import jax

from pipejax.compile import messages
from pipejax.compile.fsdp import ShardedWeights
from pipejax.compile.lanes import TickTask
from pipejax.compile.op_loops import OpLoops
from pipejax.compile.stages import StageCode
from pipejax.compile.table_state import Ops, TickContext
from pipejax.schedules import Op


def split_functions(code: StageCode, j: int) -> tuple[tuple[Callable, tuple], ...]:
    """B and W of virtual stage j's split backward (`code.splits`), each a
    function with its abstract arguments (to count or time them alone)."""
    split = code.splits[code.groups.of[j]]
    leaves = jax.tree.leaves(code.backward_args(j))
    bridge = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in split.avals]
    return ((lambda *a: split.run_b(a), tuple(leaves)),
            (split.run_w, ([leaves[i] for i in split.reread], bridge)))


class SplitBackwardOps:
    """The B and W ops of a tick (`table._Tick`): each in its loop
    (`loops`), on the weights `weights` reads (gathered where sharded), on
    the micro-batch `inputs(g, j)` gives: (x_m, y_m, key, first layer of j)."""

    def __init__(self, tick: TickContext, loops: OpLoops, weights: ShardedWeights,
                 inputs: Callable[[jax.Array, jax.Array], tuple]):
        self.tick, self.loops, self.weights, self.inputs = tick, loops, weights, inputs

    def _with_weights(self, ops: Ops, w: tuple) -> Ops:
        """`ops` after a loop that carried the weights `w` (in place): the
        stage's own, or, where sharded, a gathered copy the loop leaves alone."""
        return ops if self.tick.sharded else ops._replace(params=w)

    def _rows(self, task: TickTask) -> tuple:
        """The task's rows of the kept and the bridge rings."""
        layout = self.tick.layout
        return task.ring % layout.kept_slots, task.ring % layout.bridge_slots

    def input_grad(self, task: TickTask, ops: Ops, loss: jax.Array) -> tuple[Ops, jax.Array]:
        """Zero bubble's B of micro-batch g on virtual stage j: the input
        gradient, sent back in the buffers of the message back, and the
        bridge its W reads, written into its slot; returns the ops' state and
        the loss, the micro-batch's where B runs the last stage's forward
        (`StageCode.deferred`)."""
        rows, groups, branch = self._rows(task), self.tick.code.groups, self.tick.branches[Op.B]

        def input_grad(micro, c, rings, mail, slots):
            w, loss = c
            operands = (w, *slots, (rings.kept, rows[0]), micro, rows[1])
            bridge, back, loss = groups.run(branch, operands,
                                            (rings.bridge, messages.letter(mail, 1), loss),
                                            at=task.j)
            return (w, loss), rings._replace(bridge=bridge), messages.posted(mail, 1, back)

        (w, loss), ops = self.loops.run(Op.B, task, input_grad, self.inputs(task.g, task.j),
                                        (self.weights.weights(ops), loss), ops)
        return self._with_weights(ops, w), loss

    def weight_grad(self, task: TickTask, ops: Ops) -> Ops:
        """Zero bubble's W of micro-batch g on virtual stage j: the weight
        gradients from its input, its kept residuals and what its B filed,
        summed (a synchronous table)."""
        rows, groups, branch = self._rows(task), self.tick.code.groups, self.tick.branches[Op.W]

        def weight_grad(micro, c, rings, mail, slots):
            w, grad_sum = c
            operands = (w, *slots, (rings.kept, rows[0]), (rings.bridge, rows[1]), micro)
            if self.tick.per_chunk:
                return (w, groups.run(branch, operands, grad_sum, at=task.j)), rings, mail
            grads = groups.switch_at(task.j, branch, *operands)
            return (w, self.tick.gradients.summed(grad_sum, grads)), rings, mail

        (w, grad_sum), ops = self.loops.run(Op.W, task, weight_grad, self.inputs(task.g, task.j),
                                            (self.weights.weights(ops), ops.grad_sum), ops)
        return self._with_weights(ops, w)._replace(grad_sum=grad_sum)
