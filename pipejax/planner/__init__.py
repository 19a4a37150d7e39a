"""The planner: the pipeline configurations for a model, a batch and a machine, ranked.

Each candidate (stages × data replicas × the devices a stage is sharded
over × those its parameters are split over, schedule, virtual stages,
micro-batches, remat, compute dtype) is
built as `pj.pipeline` builds it, so what is ranked is what will run
(`search`; the settings it tries are a `Space`, the step a `Training`, the
devices and their rates a `Machine`):

  - memory: `Trainer.memory()` of its training step (state, in-flight
    buffers, rings, working set), per device, before compiling;
  - step time: the table's ticks as its collectives couple the devices
    (`costs.step_seconds`: a device that receives at a tick waits for
    its senders to end it; simulated devices in lock step), each op at its
    FLOPs over `device_flops` and the bytes
    they write to and read from the rings (kept residuals, zero bubble's
    bridge) over `memory_bandwidth` (`costs.ring_costs`), plus the
    messages over `link_bandwidth` (each collective the table runs,
    `messages.carried`, sends its message buffers, `messages.buffers`),
    plus a fixed `tick_seconds` a tick and a fixed `layer_seconds` for
    each layer an op runs (`costs.fixed_costs`: its kernels' launch,
    whatever the micro-batch's size); a data-parallel mean of the
    gradients over the link once a step (synchronous) or once a tick
    (asynchronous); a sharded stage's gather of its weights and scatter
    of their gradients over the link, (F − 1)/F of the stage's parameter
    bytes each, where the step gathers (once, or at every tick:
    compile/fsdp.py); a stage split over
    T tensor devices: the split share of its FLOPs over T, and an
    all-reduce of activations for each matrix that takes a split input,
    forward and backward (`costs.split_costs`). Devices that
    share one processor (`host_flops`: simulated CPU devices) take at
    least the FLOPs every replica's table executes over its rate;
  - staleness: the delay in effective steps (staleness.py).

Cost model assumptions: a layer's traced FLOPs (forward + backward) split
1 : 2 between forward and backward; with rematerialization a backward
recomputes its forward (not the last stage's when the table fuses its
forward and backward into one tick); a zero-bubble W takes its share of
the backward as XLA counts the split's B and W (`costs.w_shares`),
B the rest and the recomputation; every device runs at one rate,
whatever the dtype or the micro-batch's size, past each layer's fixed cost.

Modules: `search` (the ranking), `space` (what is tried), `machine` (the
rates), `costs` (each op's cost), `paths` (a table's time from its ops'),
`candidate` (a ranked configuration, and the table of them).
"""

from pipejax.planner.candidate import Candidate, render
from pipejax.planner.machine import RATES, Machine
from pipejax.planner.search import search
from pipejax.planner.space import Space, Training

__all__ = ["Candidate", "Machine", "RATES", "Space", "Training", "render", "search"]
