"""What a backward does with its gradient, chosen once per program.

A synchronous table sums every backward's gradient into the step's
gradient sum; the step updates once, after the pass (GPipe). An
asynchronous table updates the stage after every backward (PipeDream,
pipelined backpropagation): at once, inside the backward's loop, or, when
the update runs collectives (a data rule, the clip by the global norm), right
after the loop, on every device at every tick (collectives never sit in a
loop that only some devices run). A stage sharded over F devices updates
after the loop too: the whole gradient is scattered to the pieces first
(compile/fsdp.py), in a loop every device of the stage runs alike. The
table interpreter (table.py) asks this policy and does not know which one
it runs.
"""

from __future__ import annotations

from typing import Any

import jax

from pipejax.compile import fsdp
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.mesh import FSDP
from pipejax.packing import Buffers, Packing


class GradientPolicy:
    """Sum (synchronous), update inside the loop, or update after it."""

    def __init__(self, synchronous: bool, opts: StageOptimizers | None, params: Packing,
                 shards: int = 1):
        """`params`: the whole parameter packing a backward's gradient comes
        in; `shards`: the F devices each stage is sharded over."""
        self.synchronous, self.params, self.shards = synchronous, params, shards
        # The guard decides for a stage's F pieces alike.
        self.update = None if synchronous else opts.updater(scope=(FSDP,) if shards > 1 else ())
        self.after_loop = not synchronous and (opts.outer.collective or shards > 1)

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
            return p, s, tuple(a + b for a, b in zip(carried, grads)), skipped
        if self.after_loop:
            return p, s, grads, skipped
        p, s, skipped = self.update(p, grads, s)
        return p, s, carried, skipped

    def after(self, p: Buffers, s: OptState, grads: Buffers, real: jax.Array) -> tuple:
        """After the loop, on every device (`after_loop` only): (p, s, skipped)."""
        if self.shards > 1:
            pieces = self.params.shard(self.shards).zeros()
            grads = fsdp.scatter_if(real, grads, self.shards, pieces)
        return self.update(p, grads, s, real)
