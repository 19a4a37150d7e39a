"""What a backward does with its gradient, chosen once per program.

A synchronous table sums every backward's gradient into the step's
gradient sum; the step updates once, after the pass (GPipe). An
asynchronous table updates the stage after every backward (PipeDream,
pipelined backpropagation): at once, inside the backward's loop, or, when
the update runs collectives (a data rule, the clip by the global norm), right
after the loop, on every device at every tick (collectives never sit in a
loop that only some devices run). A stage sharded over F devices whose
weights are gathered at each tick scatters a backward's whole gradient to
its pieces inside the loop (compile/fsdp.py: every device of one stage runs
that loop alike), so the sum, the update and the state hold pieces and no
whole gradient outlives the op. The table interpreter (table.py) asks this
policy and does not know which one it runs.
"""

from __future__ import annotations

from typing import Any

import jax

from pipejax.compile.spmd import scatter
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.mesh import FSDP
from pipejax.packing import Buffers, Packing


class GradientPolicy:
    """Sum (synchronous), update inside the loop, or update after it."""

    def __init__(self, synchronous: bool, opts: StageOptimizers | None, pieces: Packing,
                 scatter: int = 1):
        """`pieces`: the packing the sum and the update hold (the whole
        parameters, or a device's pieces); `scatter`: F where a backward's
        whole gradient is scattered to F pieces in its loop, else 1."""
        self.synchronous, self.params, self.scatter = synchronous, pieces, scatter
        # The guard decides for a stage's F pieces alike.
        self.update = None if synchronous else opts.updater(scope=(FSDP,) if scatter > 1 else ())
        self.after_loop = not synchronous and opts.outer.collective

    def carried(self, grad_sum: Any) -> Any:
        """What a backward's loop carries for the gradient: the step's running
        sum (synchronous), a slot for this op's gradient (updated after the
        loop), or nothing (updated inside it)."""
        if self.synchronous:
            return grad_sum
        return self.params.zeros() if self.after_loop else ()

    def take(self, p: Buffers, s: OptState, carried: Any, grads: Buffers,
             skipped: jax.Array) -> tuple:
        """Inside the loop: (p, s, carried, skipped) after a backward's `grads`."""
        if self.synchronous:
            return p, s, self.summed(carried, grads), skipped
        grads = self._pieces(grads)
        if self.after_loop:
            return p, s, grads, skipped
        p, s, skipped = self.update(p, grads, s)
        return p, s, carried, skipped

    def summed(self, total: Buffers, grads: Buffers) -> Buffers:
        """Inside the loop: a synchronous sum after a backward's `grads`."""
        return tuple(a + b for a, b in zip(total, self._pieces(grads)))

    def _pieces(self, grads: Buffers) -> Buffers:
        """A backward's gradient as the sum and the update hold it."""
        return scatter(grads, self.scatter, self.params) if self.scatter > 1 else grads

    def after(self, p: Buffers, s: OptState, grads: Buffers, real: jax.Array) -> tuple:
        """After the loop, on every device (`after_loop` only): (p, s, skipped)."""
        return self.update(p, grads, s, real)
