"""The memory a training step needs on each device, predicted before compiling.

DeepSpeed's users find the first and last stages using 25–30 % more memory
than predicted; here the prediction is made from the same buffers the
program allocates, and `benchmarks/run_all.py` checks it against XLA's
`memory_analysis()` of the compiled step (argument + output + temp bytes).

What a step holds on one device (every device allocates the padded size of
the largest stage: SPMD buffers have one shape):
  - its state, donated (the step writes the new state into the old one's
    buffers): the parameters and optimizer state, the in-flight state of
    an asynchronous pipeline (rings, data rings, stashed weights or a
    double-buffered table's versions, which the tick loop updates in place:
    counting its rings again over-predicted the ResNet's PB step by 20 %);
    the batch;
  - the ring buffers of the table (stage inputs, output gradients and, in
    a synchronous step, kept residuals), which a synchronous trainer's
    state carries from step to step (`TrainState.scratch`);
  - a synchronous step's gradient sum;
  - the working set of one micro-batch's backward: the temporary and
    output buffers of the stage's backward compiled alone (`backward_bytes`:
    with remat, what the forward it replays keeps; without, its cotangents,
    the forward having written each residual into its ring row,
    compile/rows.py; and its gradient), beside the tick's messages (an
    activation and a gradient, or one buffer for both where no device runs
    a forward and a backward at one tick, `Schedule.messages`, which every
    op's loop carries; those received arrive after the tick's last op:
    without them a synchronous step with remat is under-predicted, the GPT
    6x64's and the ResNet's); after the scan, in their place, a
    synchronous step's update (`update_bytes`): the larger of the two;
  - an asynchronous step updates parameters and optimizer state at every
    tick: in the backward's op, beside its working set, where the update
    has no collectives (`update_bytes`; counting the update's result beside
    the values it reads instead over-predicted an MLP 16x512's steps by
    26 %); around the stage switch where it has (a data rule, the clip),
    the update's result beside the values it reads (one copy; the
    forward's loop hands the weights on through an optimization barrier,
    so XLA makes no other), live at other times than the working set and
    the gradient it makes, which leaves the switch for the rule's
    collectives (without it the GPT 6x64's PB step on 8 replicas was
    under-predicted by 7.7 %): the larger of the two;
  - on a stage sharded over F devices (compile/fsdp.py) each device holds
    its piece of the parameters, optimizer state and gradient sum and its
    part of the batch and activations, and besides them the whole weights
    of a tick (two copies where the forward and the backward run on
    different weights; a backward's whole gradient is scattered in its op,
    within the working set); with fsdp_gather="step" the whole weights and
    the whole gradient sum, for the whole step;
  - on a stage split over T tensor devices (compile/tensor.py) each holds
    the blocks of its split parameters (and of their optimizer state and
    gradients, and of the residuals XLA splits), and the working set as XLA
    partitions it: its backward compiled alone on one group of T devices, as
    unsplit (`tensor.backward_bytes`; `benchmarks/planner.py --part sharded`).
Which buffers XLA copies or reuses was read off the compiled MLP and ResNet
steps (K = 4, every schedule and remat mode); `benchmarks/run_all.py`
reports the error of the total for each.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from pipejax import caches
from pipejax.compile.build import Build
from pipejax.compile.fsdp import apart
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.stages import StageCode
from pipejax.compile.tensor import backward_bytes as split_backward_bytes
from pipejax.packing import Packing
from pipejax.formatting import human_bytes, table
from pipejax.trace import nbytes


FAST_COMPILE = {"xla_backend_optimization_level": 0}  # a program compiled to be measured


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes by part: `stages[k]` what stage k's own trees need
    (unpadded), `device` what every device allocates (padded to the largest
    stage; compare it with the compiled step's memory_analysis())."""

    stages: tuple[dict[str, int], ...]
    device: dict[str, int]

    @property
    def total(self) -> int:
        """Predicted peak bytes of one device."""
        return sum(self.device.values())

    @property
    def heaviest(self) -> int:
        """The stage whose own trees need the most."""
        return int(np.argmax([sum(s.values()) for s in self.stages]))

    def __str__(self) -> str:
        parts = list(self.device)
        rows = [["part", *[f"stage {k}" for k in range(len(self.stages))], "device"]]
        rows += [[p, *[human_bytes(s[p]) for s in self.stages], human_bytes(self.device[p])]
                 for p in parts]
        rows.append(["total", *[human_bytes(sum(s.values())) for s in self.stages],
                     human_bytes(self.total)])
        lines = [table(rows)]
        lines.append("predicted per device, before compiling (stage columns: each stage's own "
                     "trees; device: padded to the largest, what each device allocates)")
        return "\n".join(lines)


def estimate(build: Build, opts: StageOptimizers) -> MemoryEstimate:
    """The `MemoryEstimate` of the training step of `build` updated by `opts`."""
    code, layout, schedule = build.code, build.layout, build.schedule
    opt_state = opts.packing
    micro = nbytes(build.example) + nbytes(build.targets)
    batch = schedule.microbatches * micro  # a device's part of the batch
    unsplit = code.params.tensor == 1
    # A backward compiled alone is the working set, split or not.
    working = [backward_bytes(code, j) if unsplit else
               split_backward_bytes(code, j, build.mesh, FAST_COMPILE)
               for j in code.groups.first]
    # An update without collectives runs in the stage switch (`StageOptimizers.updater`).
    fused = not opts.outer.collective
    updates = [update_bytes(opts, k) if unsplit and (schedule.synchronous or fused) else 0
               for k in range(build.K)]
    twice = apart(layout, opts)  # a sharded stage gathers the forward's and the backward's
    def parts(used, chunk_used, act_in: int, act_out: int, work: int,
              update: int) -> dict[str, int]:
        """One stage's parts; `used(packing)` is its bytes of a packing per
        device, `chunk_used(packing)` the most one of its chunks uses."""
        P, S, kept = used(layout.pieces), used(opt_state), chunk_used(code.kept)
        moving = layout.input_slots * act_in + layout.grad_slots * act_out
        if layout.bridge_slots:
            moving += layout.bridge_slots * chunk_used(code.bridge)
        out = {"parameters": P, "optimizer state": S, "batch": batch}
        step = build.stage.gathers_once
        if build.stage.sharded:
            whole = used(code.params)
            out["gathered weights"] = whole * (2 if twice else 1)
        gradient = whole if step else P
        if schedule.synchronous:
            out.update({"rings": moving + layout.kept_slots * kept, "gradient sum": gradient})
            # The tick's messages, which every op's loop carries: an activation and a
            # gradient, or one buffer for both (those received arrive after the last
            # op, the working set gone).
            one = schedule.messages == 1
            messages = (max(act_in, act_out) if one else act_in + act_out) if build.K > 1 else 0
            # A split stage's update is XLA's to partition: a copy of its weights instead.
            out["working set and messages, or update"] = max(work + messages, update)
        else:
            stash = layout.kept_slots * P if layout.weight_stashing else 0
            stash += 2 * P if layout.versions else 0  # W(v − 1) and the step's gradient
            held = moving + layout.kept_slots * kept + stash + layout.data_slots * micro
            out["in-flight state"] = held  # its rings updated in place by the loop
            # Around the switch, the backward's gradient leaves it for the
            # rule's collectives: held beside the working set that makes it.
            # A split stage's working set (its backward compiled alone over
            # tensor) holds that gradient already: counted again, PB's step of
            # the GPT 6x64 at tensor 2 was over-predicted by 5.5 %.
            beside = gradient if unsplit else 0
            out.update({"working set and update": work + update} if fused and unsplit else
                       {"working set and gradient, or update copy":
                        max(work + beside, P + S)})
        return out

    acts, S = code.acts, code.S
    most = lambda k, f: max(f(j) for j in code.placement.device_chunks(k))  # over device k's chunks
    stages = tuple(parts(lambda p, k=k: p.used_bytes(k),
                         lambda p, k=k: most(k, p.used_bytes),
                         most(k, lambda j: acts.used_bytes(j - 1) if j > 0 else 0),
                         most(k, lambda j: acts.used_bytes(j) if j < S - 1 else 0),
                         most(k, lambda j: working[code.groups.of[j]]), updates[k])
                   for k in range(build.K))
    device = parts(Packing.slot_bytes, Packing.slot_bytes, acts.slot_bytes(), acts.slot_bytes(),
                   max(working), max(updates))
    return MemoryEstimate(stages, device)


def backward_bytes(code: StageCode, j: int) -> int:
    """The working set of one micro-batch's backward on virtual stage j:
    XLA's temporary and output buffers of that backward compiled alone (a
    stage switch's branch returns its gradient in a buffer of its own,
    which the step then adds into the sum or its update reads). Its inputs,
    the weights, the stage input, the kept residuals and the output
    gradient, live where the step holds them. Counting what the vjp keeps
    without rematerialization instead over-predicted the GPT 6x64's remat
    "stage" steps by 15–24 % (XLA's fusions recompute what the jaxpr
    keeps); leaving the outputs out under-predicted the MLP 4x256's
    synchronous steps by 20–24 %. Compiled once per process for equal
    stages (`StageCode.remembered`), without the backend's code optimizations
    (LLVM's; XLA's buffers are assigned before them: the same bytes, in 0.6
    of the time on the GPT 6x64's stages)."""
    def compiled() -> int:
        lowered = jax.jit(functools.partial(code.backward, j)).lower(*code.backward_args(j))
        analysis = lowered.compile(FAST_COMPILE).memory_analysis()
        return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)

    return code.remembered(j, ("backward bytes", code.model.remat), compiled)


def update_bytes(opts: StageOptimizers, k: int) -> int:
    """The temporary buffers of stage k's optax update compiled alone, its
    packed parameters and state donated as the step donates them. Where a
    slot is flat (a padded or reshaped leaf of a heterogeneous stage), XLA
    fuses the state's update into the weights' a second time, so it copies
    the old state first and writes the new weights beside the old: Adam on
    the MLP 8x256's first stage (K = 4) holds three slot-sized copies, 778
    KiB; where every slot keeps its leaves' shape, none. A synchronous
    step holds these buffers after the scan, where the backward's working
    set was (counting a copy of the weights beside the working set instead
    over-predicted an MLP 16x512's steps by 15-19 %, `python
    benchmarks/planner.py --part memory`); an asynchronous one in the
    backward's op, beside it. Compiled once per process for equal stages
    and transform (`caches.UPDATES`)."""
    params, state = opts.params, opts.packing
    transform = opts.transforms[k]
    key = (params.slots, params.structure(k), state.slots, state.structure(k))

    def compiled() -> int:
        update = opts.stage_update(k)
        slots = lambda packing: tuple(jax.ShapeDtypeStruct(shape, dtype)
                                      for dtype, shape in packing.slots)
        program = jax.jit(update, donate_argnums=(0, 2))
        lowered = program.lower(slots(params), slots(params), slots(state))
        return int(lowered.compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes)

    same = lambda entry, mine: entry[0] is mine[0] and entry[1] == mine[1]
    return caches.recall(caches.UPDATES, (transform, key), compiled, same)
