"""Zero bubble's B and W inside a tick (Qi et al. 2024, §2): the input
gradient of a micro-batch, sent back at once with what its W needs filed in
a bridge slot, and the weight gradient later from its kept residuals and
that bridge. The table interpreter's tick (table.py) runs them beside its
forward and fused backward; they read the tick's state (`Ops`) and its
stage's branches as those do.
"""

from __future__ import annotations

from typing import Callable

import jax

from pipejax.compile import messages
from pipejax.compile.gradients import GradientPolicy
from pipejax.compile.layout import Layout
from pipejax.compile.stages import StageCode
from pipejax.compile.lanes import TickTask
from pipejax.compile.table_state import Ops
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
    """The B and W ops of `table._Tick` (a mixin: the tick's code, layout,
    branches, `_run_on_rings` and `_inputs` are its own)."""

    code: StageCode
    layout: Layout
    branches: dict[Op, Callable]
    per_chunk: bool  # a synchronous table over v > 1 chunks: W adds into its chunk's slots
    _run_on_rings: Callable  # (op, task, fn, operands, carry, ops): the op's loop
    _inputs: Callable  # (g, j) -> (x_m, y_m, key, first layer of j)
    weights: Callable  # (ops) -> the weights the ops run on (gathered where sharded)
    gradients: GradientPolicy  # how a weight gradient joins the sum

    @staticmethod
    def _with_weights(ops: Ops, w: tuple) -> Ops:
        """`ops` after a loop that carried the weights `w` (in place): the
        stage's own, or, where sharded, a gathered copy the loop leaves alone."""
        return ops if ops.whole else ops._replace(p=w)

    def _rows(self, task: TickTask) -> tuple:
        """The task's rows of the kept and the bridge rings."""
        return task.ring % self.layout.kept_slots, task.ring % self.layout.bridge_slots

    def _input_grad(self, task: TickTask, ops: Ops, loss: jax.Array) -> tuple[Ops, jax.Array]:
        """Zero bubble's B of micro-batch g on virtual stage j: the input
        gradient, sent back in the buffers of the message back, and the
        bridge its W reads, written into its slot; returns the ops' state and
        the loss, the micro-batch's where B runs the last stage's forward
        (`StageCode.deferred`)."""
        rows = self._rows(task)

        def input_grad(micro, c, rings, mail, slots):
            w, loss = c
            operands = (w, *slots, (rings.kept, rows[0]), micro, rows[1])
            bridge, back, loss = self.code.groups.run(
                self.branches[Op.B], operands, (rings.bridge, messages.letter(mail, 1), loss),
                at=task.j)
            return (w, loss), rings._replace(bridge=bridge), messages.posted(mail, 1, back)

        (w, loss), ops = self._run_on_rings(Op.B, task, input_grad, self._inputs(task.g, task.j),
                                            (self.weights(ops), loss), ops)
        return self._with_weights(ops, w), loss

    def _weight_grad(self, task: TickTask, ops: Ops) -> Ops:
        """Zero bubble's W of micro-batch g on virtual stage j: the weight
        gradients from its input, its kept residuals and what its B filed,
        summed (a synchronous table)."""
        rows = self._rows(task)

        def weight_grad(micro, c, rings, mail, slots):
            w, grad_sum = c
            operands = (w, *slots, (rings.kept, rows[0]), (rings.bridge, rows[1]), micro)
            if self.per_chunk:
                return (w, self.code.groups.run(self.branches[Op.W], operands, grad_sum,
                                                at=task.j)), rings, mail
            grads = self.code.groups.switch_at(task.j, self.branches[Op.W], *operands)
            return (w, self.gradients.summed(grad_sum, grads)), rings, mail

        (w, grad_sum), ops = self._run_on_rings(Op.W, task, weight_grad,
                                                self._inputs(task.g, task.j),
                                                (self.weights(ops), ops.grad_sum), ops)
        return self._with_weights(ops, w)._replace(grad_sum=grad_sum)
