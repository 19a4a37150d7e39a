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
whole gradient outlives the op. A double-buffered table (PipeDream-2BW)
sums a step's gradients and updates once a step, every op on its step's
weight version (versions.py). The table interpreter (table.py) asks this
policy and does not know which one it runs.
"""

from __future__ import annotations

from typing import Any

import jax

from pipejax.compile import versions
from pipejax.compile.spmd import scatter
from pipejax.compile.state import Rings
from pipejax.compile.optimizer import OptState, StageOptimizers
from pipejax.mesh import FSDP
from pipejax.packing import Buffers, Packing


class GradientPolicy:
    """Sum (synchronous), update inside the loop, or update after it; or
    sum a step's and update once (double-buffered)."""

    def __init__(self, synchronous: bool, opts: StageOptimizers | None, pieces: Packing,
                 scatter: int = 1, per_step: int = 0):
        """`pieces`: the packing the sum and the update hold (the whole
        parameters, or a device's pieces); `scatter`: F where a backward's
        whole gradient is scattered to F pieces in its loop, else 1;
        `per_step`: a double-buffered table's micro-batches a step, else 0."""
        self.synchronous, self.params, self.scatter = synchronous, pieces, scatter
        self.per_step = per_step
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

    def weights(self, w: Buffers, rings: Rings, g: jax.Array) -> Buffers:
        """The weights micro-batch g's op runs on: `w`, or double-buffered
        its step's version (versions.py)."""
        return versions.weights(w, rings.versions, g, self.per_step) if self.per_step else w

    def take(self, c: tuple, grads: Buffers, g: jax.Array) -> tuple:
        """Inside the loop, `c` = (p, s, carried, rings, skipped) after
        micro-batch g's `grads`: summed into `carried` (synchronous) or a
        double-buffered step's sum in `rings`, kept for the update after the
        loop, or applied."""
        p, s, carried, rings, skipped = c
        if self.synchronous:
            return p, s, self.summed(carried, grads), rings, skipped
        grads = self._pieces(grads)
        if self.per_step and self.after_loop:  # the step's sum; its update follows the loop
            return p, s, carried, rings._replace(versions=versions.add(rings.versions, grads)), \
                skipped
        if self.per_step:
            p, s, v, skipped = versions.take(self.update, self.per_step,
                                             (p, s, rings.versions, skipped), grads, g)
            return p, s, carried, rings._replace(versions=v), skipped
        if self.after_loop:
            return p, s, grads, rings, skipped
        p, s, skipped = self.update(p, grads, s)
        return p, s, carried, rings, skipped

    def summed(self, total: Buffers, grads: Buffers) -> Buffers:
        """Inside the loop: a synchronous sum after a backward's `grads`."""
        return tuple(a + b for a, b in zip(total, self._pieces(grads)))

    def _pieces(self, grads: Buffers) -> Buffers:
        """A backward's gradient as the sum and the update hold it."""
        return scatter(grads, self.scatter, self.params) if self.scatter > 1 else grads

    def after(self, p: Buffers, s: OptState, grads: Buffers, rings: Rings, real: jax.Array,
              g: jax.Array) -> tuple:
        """After the loop, on every device (`after_loop` only), the op's
        `grads` or double-buffered micro-batch g's step's sum: (p, s,
        rings, skipped)."""
        if not self.per_step:
            p, s, skipped = self.update(p, grads, s, real)
            return p, s, rings, skipped
        p, s, v, skipped = versions.take_after(self.update, self.per_step,
                                               (p, s, rings.versions), g, real)
        return p, s, rings._replace(versions=v), skipped
