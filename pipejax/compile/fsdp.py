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
  forecasts its weights for the forward (or stashes them) gathers the
  forward's weights and the backward's apart: two gathers at a tick that
  runs both. The gathers and scatters run in loops of 0 or 1 trips on the
  tick's task: every device of one stage takes the same trip, so the
  collective over `fsdp` meets (XLA CPU's rendezvous hangs only where a
  collective's devices take different trips; measured on 8 simulated
  devices).
- "step" (synchronous tables; MaxText's `pipeline_fsdp_ag_once`): once per
  step, before the scan, the weights whole on every device for the whole
  pass, and the gradient sum whole until it is scattered once after the
  pass: one gather and one scatter a step instead of one a busy tick, for
  a whole gradient sum held through the step.

Measured (AdamW, K = 2, `benchmarks/fsdp_memory.py`): the compiled temp
memory of the zoo GPT's 1F1B step at F = 4 is 28.3 MB under "tick" and
33.1 MB under "step", an MLP's 13.4 MB and 17.2 MB; what the step keeps
(parameters, optimizer state, batch) is 0.251 of F = 1's under both.
"""

from __future__ import annotations

import jax
from jax import lax

from pipejax.compile.spmd import run_if
from pipejax.mesh import FSDP
from pipejax.packing import Buffers


def gather(pieces: Buffers) -> Buffers:
    """Inside shard_map: every slot whole from this stage's F pieces."""
    return tuple(lax.all_gather(b, FSDP, axis=0, tiled=True) for b in pieces)


def scatter(grads: Buffers, shards: int) -> Buffers:
    """Inside shard_map: this device's piece of the mean over the stage's F
    devices of the whole gradients `grads`."""
    return tuple(lax.psum_scatter(g, FSDP, scatter_dimension=0, tiled=True) / shards
                 for g in grads)


def gather_if(pred: jax.Array | None, pieces: Buffers, whole: Buffers) -> Buffers:
    """`gather(pieces)` where `pred` (None: always), else `whole` (zeros of
    the whole slots' shapes) untouched."""
    if pred is None:
        return gather(pieces)
    return run_if(pred, lambda ops, _: gather(ops), pieces, whole)
