"""A stage sharded over the devices of mesh axis `fsdp` (ZeRO-3, Rajbhandari
et al. 2020, §5: parameters, gradients and optimizer state partitioned).

Each of a stage's F devices holds the f-th of F equal pieces of every
packed slot (packing.py, `Packing.shard`) of its parameters, and the
optimizer state and data-rule state of that piece; it runs the f-th of F
equal parts of every micro-batch. Before the ops that use them, the stage's
weights are gathered whole (`all_gather` over `fsdp`); a backward's weight
gradient, whole on each device, is summed over the F devices and scattered
back to the pieces (`psum_scatter`), divided by F: each device's loss is
the mean over its part of the micro-batch, so the mean of the F gradients
is the micro-batch's.

Where the gathers sit (`pj.pipeline(..., fsdp_gather=)`):

- "tick" (the default; the only choice for asynchronous tables, which
  update the weights at every backward): at every tick whose ops use the
  weights, once, before the ops, for all of them (1F1B's forward and
  backward of one tick read one gather); a backward's whole weight
  gradient is scattered to the pieces in the op's own loop, so the sum
  holds pieces and no whole gradient outlives the op. A stage that
  forecasts its weights for the forward (or stashes them, or, double-
  buffered, runs each op on its step's version) gathers the forward's
  weights and the backward's apart: two gathers at a tick that runs both.
  The gathers and scatters run in loops of 0 or 1 trips on the tick's
  task: every device of one stage takes the same trip, so the collective
  over `fsdp` meets (XLA CPU's rendezvous hangs only where a
  collective's devices take different trips; measured on 8 simulated
  devices).
- "step" (synchronous tables; MaxText's `pipeline_fsdp_ag_once`): once per
  step, before the scan, the weights whole on every device for the whole
  pass, and the gradient sum whole until it is scattered once after the
  pass: one gather and one scatter a step instead of one a busy tick, for
  a whole gradient sum held through the step.

`ShardedWeights` places the gathers in the table interpreter's tick.

Measured (AdamW, K = 2, `benchmarks/sharding_memory.py`): the compiled temp
memory of the zoo GPT's 1F1B step at F = 4 is 28.3 MB under "tick" and
33.1 MB under "step", an MLP's 13.4 MB and 17.2 MB; what the step keeps
(parameters, optimizer state, batch) is 0.251 of F = 1's under both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pipejax.compile import messages
from pipejax.compile.lanes import TickTask
from pipejax.compile.layout import Layout
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.spmd import gather, run_if
from pipejax.compile.table_state import Ops, TickContext
from pipejax.packing import Buffers, Packing
from pipejax.schedules import Op


def gather_if(pred: jax.Array | None, pieces: Buffers, whole: Buffers,
              packing: Packing) -> Buffers:
    """`gather(pieces)` where `pred` (None: always), else `whole` (buffers of
    the whole slots' shapes: the last tick's gather) untouched."""
    if pred is None:
        return gather(pieces, packing)
    return run_if(pred, lambda ops, _: gather(ops, packing), pieces, whole)


def apart(layout: Layout, opts: StageOptimizers | None) -> bool:
    """Whether a stage's backward runs on other weights than its forward, so
    that a sharded stage gathers both: the stashed ones, another step's
    version (double-buffered), or where some stage forecasts its weights."""
    return layout.weight_stashing or bool(layout.versions) or (
        opts is not None and (any(opts.forecasting) or opts.forecasts_backward))


class ShardedWeights:
    """How the table interpreter's tick (table.py) reads a stage's weights:
    a sharded stage's gathered before its ops, else its own."""

    def __init__(self, tick: TickContext):
        self.tick = tick

    def _any(self, preds: list[jax.Array]) -> jax.Array | None:
        """Whether any of `preds` holds; None (always) when every op runs at every tick."""
        return None if self.tick.busy else functools.reduce(jnp.logical_or, preds)

    def gathered(self, runs: dict, fused: TickTask | None, ops: Ops, held: tuple) -> tuple:
        """A sharded stage's whole weights for this tick's ops: (the
        forward's, the backward's), gathered once each where some op of the
        tick uses them, once for both where they are the same weights (the
        forward's: the forecast `ahead`, or the weights; the backward's: the
        stashed ones, a backward forecast, the weights under a forecast)."""
        if self.tick.whole is not None:
            return self.tick.whole, self.tick.whole
        ahead = self.tick.opts is not None and ops.opt_state.ahead
        forward = ops.opt_state.ahead if ahead else ops.params
        backward = None
        if self.tick.layout.versions:  # each op's step's version, its pieces (versions.py)
            f = runs[Op.F]
            g = f.g if fused is None else jnp.where(f.real, f.g, fused.g)
            forward = self.tick.gradients.weights(ops.params, ops.rings, g)
        if Op.BW in runs and self.apart:
            if self.tick.layout.versions:
                backward = self.tick.gradients.weights(ops.params, ops.rings, runs[Op.BW].g)
            elif self.tick.layout.weight_stashing:
                slot = runs[Op.BW].ring % self.tick.layout.kept_slots
                backward = messages.read(ops.rings.weights, slot)
            elif self.tick.opts.forecasts_backward:
                backward = self.tick.opts.backward_weights(ops.params, ops.opt_state)
            else:  # the forward runs on a forecast, the backward on the weights
                backward = ops.params
        users = [runs[op].real for op in (Op.F, Op.B, Op.W) if op in runs]
        users += [] if fused is None else [fused.real]
        users += [runs[Op.BW].real] if backward is None and Op.BW in runs else []
        packing = self.tick.code.params
        first = gather_if(self._any(users), forward, held[0], packing)
        if backward is None:
            return first, first
        return first, gather_if(self._any([runs[Op.BW].real]), backward, held[1], packing)

    def held(self) -> tuple:
        """What the scan carries for a stage gathered at each tick: the
        buffers its gathers write, the forward's (and the backward's, where
        it gathers them apart), so that a tick that gathers nothing keeps
        the last ones. With zeros as the gathers' default instead, XLA
        filled a whole stage at every tick (1F1B, zoo GPT depth 4 width 128,
        K = 2, F = 2: 21 copies, 1.25 MB a tick; none carried)."""
        if not self.tick.sharded or self.tick.whole is not None:
            return ()
        return (self.tick.code.params.zeros(),) * (2 if self.apart else 1)

    @functools.cached_property
    def apart(self) -> bool:
        return apart(self.tick.layout, self.tick.opts)

    def weights(self, ops: Ops) -> Buffers:
        """The weights the tick's forward, B and W run on: the whole ones
        gathered (a sharded stage), else the stage's own."""
        return ops.whole[0] if self.tick.sharded else ops.params
