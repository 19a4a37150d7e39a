"""Zero bubble's B and W inside a tick (Qi et al. 2024, §2): the input
gradient of a micro-batch, sent back at once with what its W needs filed in
a bridge slot, and the weight gradient later from its kept residuals and
that bridge. The table interpreter's tick (table.py) runs them beside its
forward and fused backward; they read the tick's state (`Ops`) and its
stage's branches as those do.
"""

from __future__ import annotations

from typing import Callable

from pipejax.compile import messages
from pipejax.compile.gradients import GradientPolicy
from pipejax.compile.layout import Layout
from pipejax.compile.stages import StageCode
from pipejax.compile.lanes import TickTask
from pipejax.compile.table_state import Ops
from pipejax.schedules import Op


class SplitBackwardOps:
    """The B and W ops of `table._Tick` (a mixin: the tick's code, layout,
    branches, `_run` and `_inputs` are its own)."""

    code: StageCode
    layout: Layout
    branches: dict[Op, Callable]
    per_chunk: bool  # a synchronous table over v > 1 chunks: W adds into its chunk's slots
    _run: Callable  # run_if, or the op itself when every op runs at every tick
    _inputs: Callable  # (g, j) -> (x_m, y_m, key, first layer of j)
    weights: Callable  # (ops) -> the weights the ops run on (gathered where sharded)
    gradients: GradientPolicy  # how a weight gradient joins the sum

    @staticmethod
    def _with_weights(ops: Ops, w: tuple) -> Ops:
        """`ops` after a loop that carried the weights `w` (in place): the
        stage's own, or, where sharded, a gathered copy the loop leaves alone."""
        return ops if ops.whole else ops._replace(p=w)

    def _input_grad(self, task: TickTask, ops: Ops, read: tuple) -> tuple:
        """Zero bubble's B of micro-batch g on virtual stage j: the input
        gradient, sent back, and the bridge its W reads, filed in its slot."""
        kept_slot = task.ring % self.layout.kept_slots
        bridge_slot = task.ring % self.layout.bridge_slots

        def input_grad(args, c):
            w, bridge, _ = c
            new, msg = self.code.groups.switch_at(task.j, self.branches[Op.B], w, *args)
            return w, tuple(b.at[bridge_slot].set(v) for b, v in zip(bridge, new)), msg

        h, ct = read
        args = (h, ct, messages.read(ops.kept, kept_slot), self._inputs(task.g, task.j))
        w, bridge, msg = self._run(task.real, input_grad, args,
                                   (self.weights(ops), ops.bridge, self.code.acts.zeros()))
        return self._with_weights(ops, w)._replace(bridge=bridge), msg

    def _weight_grad(self, task: TickTask, ops: Ops, read: tuple) -> Ops:
        """Zero bubble's W of micro-batch g on virtual stage j: the weight
        gradients from its input, its kept residuals and what its B filed,
        summed (a synchronous table). It reads the kept and bridge slots
        after the tick's F and B, so that XLA updates those rings in place."""
        read = (*read, messages.read(ops.kept, task.ring % self.layout.kept_slots),
                messages.read(ops.bridge, task.ring % self.layout.bridge_slots))
        def weight_grad(args, c):
            w, grad_sum = c
            if self.per_chunk:
                return w, self.code.groups.run(self.branches[Op.W], (w, *args), grad_sum,
                                               at=task.j)
            grads = self.code.groups.switch_at(task.j, self.branches[Op.W], w, *args)
            return w, self.gradients.summed(grad_sum, grads)

        w, grad_sum = self._run(task.real, weight_grad, (*read, self._inputs(task.g, task.j)),
                                (self.weights(ops), ops.grad_sum))
        return self._with_weights(ops, w)._replace(grad_sum=grad_sum)
