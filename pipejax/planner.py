"""`pj.search`: the pipeline configurations for a model, a batch and N devices, ranked.

Each candidate (stages × data replicas × the devices a stage is sharded
over × those its parameters are split over, schedule, virtual stages,
micro-batches, remat, compute dtype) is
built as `pj.pipeline` builds it, so what is ranked is what will run:

  - memory: `Trainer.memory()` of its training step (state, in-flight
    buffers, rings, working set), per device, before compiling;
  - step time: the table's ticks as its collectives couple the devices
    (`step_costs.step_seconds`: a device that receives at a tick waits for
    its senders to end it; simulated devices in lock step), each op at its
    FLOPs over `device_flops` and the bytes
    they write to and read from the rings (kept residuals, zero bubble's
    bridge) over `memory_bandwidth` (`step_costs.ring_costs`), plus the
    messages over `link_bandwidth` (each collective the table runs,
    `messages.carried`, sends its message buffers, `messages.buffers`),
    plus a fixed `tick_seconds` a tick and a fixed `layer_seconds` for
    each layer an op runs (`step_costs.fixed_costs`: its kernels' launch,
    whatever the micro-batch's size); a data-parallel mean of the
    gradients over the link once a step (synchronous) or once a tick
    (asynchronous); a sharded stage's gather of its weights and scatter
    of their gradients over the link, (F − 1)/F of the stage's parameter
    bytes each, where the step gathers (once, or at every tick:
    compile/fsdp.py); a stage split over
    T tensor devices: the split share of its FLOPs over T, and an
    all-reduce of activations for each matrix that takes a split input,
    forward and backward (`step_costs.split_costs`). Devices that
    share one processor (`host_flops`: simulated CPU devices) take at
    least the FLOPs every replica's table executes over its rate;
  - staleness: the delay in effective steps (staleness.py).

Cost model assumptions: a layer's traced FLOPs (forward + backward) split
1 : 2 between forward and backward; with rematerialization a backward
recomputes its forward (not the last stage's when the table fuses its
forward and backward into one tick); a zero-bubble W takes its share of
the backward as XLA counts the split's B and W (`step_costs.w_shares`),
B the rest and the recomputation; every device runs at one rate,
whatever the dtype or the micro-batch's size, past each layer's fixed cost.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.bench.op_costs import busy_ticks
from pipejax.compile.memory import estimate
from pipejax.compile.messages import buffers, carried
from pipejax.compile.programs import crossing
from pipejax.errors import ConfigError, DeviceError, LayerError
from pipejax.formatting import human_bytes, table
from pipejax.mesh import make_mesh
from pipejax.pipeline import Pipeline, pipeline
from pipejax.schedules import FAMILIES, Op, names
from pipejax.schedules.bubbles import table_bubble_fraction
from pipejax.staleness import STABLE_DELAY, advise, effective_delay
from pipejax.step_costs import (fixed_costs, op_costs, ring_costs, split_costs, step_seconds,
                                w_shares)
from pipejax.transforms.data_parallel import ssgd

@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and what it is predicted to cost."""

    schedule: str
    stages: int  # K
    data: int  # replicas
    fsdp: int  # F, the devices each stage is sharded over
    tensor: int  # T, the devices each annotated parameter is split over
    virtual: int  # v, chunks per device
    microbatches: int  # M per replica and step
    microbatch: int  # examples per micro-batch
    remat: str
    compute_dtype: str
    step_seconds: float  # predicted, one step of the whole batch
    memory_bytes: int  # predicted peak per device
    bubble: float  # idle share of the table's op slots
    effective_delay: float | None  # η/(1 − m)·D, largest stage; 0 synchronous; None unknown
    stable: bool | None  # effective_delay ≤ STABLE_DELAY (with LWP_D + SC_D); None: unknown
    advice: str

    def pipeline_args(self) -> dict[str, Any]:
        """The `pj.pipeline` arguments that build this candidate (but layers,
        loss, example and targets); with data replicas, their mesh."""
        return dict(stages=self.stages, microbatches=self.microbatches, schedule=self.schedule,
                    virtual=self.virtual, remat=self.remat,
                    compute_dtype=None if self.compute_dtype == "float32" else self.compute_dtype,
                    mesh=(make_mesh(self.stages, self.data, fsdp=self.fsdp, tensor=self.tensor)
                          if self.data * self.fsdp * self.tensor > 1 else None))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(layers: Sequence, *, loss: Callable, example: Any, devices: int, batch: int,
           targets: Any = None, memory: float | None = None,
           learning_rate: float | None = None, momentum: float = 0.0,
           reference: tuple[float, float, int] | None = None,
           schedules: Sequence[str] | None = None, stages: Sequence[int] | None = None,
           fsdp: Sequence[int] = (1,), tensor: Sequence[int] = (1,),
           microbatches: Sequence[int] | None = None, remat: Sequence[str] = ("stage", "none"),
           compute_dtypes: Sequence[Any] = (None,),
           optimizer: optax.GradientTransformation | None = None,
           partition: str | Sequence[int] = "variance", device_flops: float = 50e12,
           link_bandwidth: float = 50e9, tick_seconds: float = 20e-6,
           host_flops: float | None = None,
           memory_bandwidth: float = 2e12, layer_seconds: float = 0.0,
           progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """The configurations of `layers` for `batch` examples a step on
    `devices` devices, best first: stable (or unknown) before unstable,
    then by predicted step time, then memory.

    Args:
      layers, loss: as `pj.pipeline` takes them.
      example: ONE example's inputs (no batch axis); the search splits the
        batch into micro-batches. targets: one example's targets (default: an
        integer class label).
      devices: N = data replicas × stages × fsdp × tensor; stages: the K to
        try (default: every divisor of N up to the number of layers); fsdp:
        the F to try, devices each stage is sharded over; tensor: the T to
        try, devices each annotated parameter is split over (a T the
        annotations do not take is left out).
      batch: examples per step, over all replicas.
      memory: bytes per device; candidates predicted above it are left out.
      learning_rate, momentum: the asynchronous update's own rate and
        momentum, or reference=(η, m, B): a synchronous recipe at batch B
        moved to the micro-batch by eq. 9 (Kosson et al. 2020).
      schedules: family names (default: the families marked `searched`),
        each built with its family's `search_virtual` chunks per device.
      microbatches: the M to try (default: K·2^i dividing a replica's batch, up to 4 of them).
      remat, compute_dtypes: the settings to try; partition: as `pj.pipeline`.
      optimizer: whose state the memory counts (default SGD with momentum).
      device_flops, link_bandwidth, tick_seconds, memory_bandwidth: the
        machine (defaults: a GPU at 50 TFLOP/s, 50 GB/s links, 20 µs a
        tick, 2 TB/s of memory); host_flops: the rate of the one processor
        the devices share, if they do (simulated CPU devices:
        `benchmarks/planner.py --part time` measures it and the rate of
        its memory as the rings use it); layer_seconds: a layer's forward's
        fixed cost, whatever the micro-batch's size (the launch of its
        kernels; its backward's twice that; default 0: none counted;
        `benchmarks/planner.py --part time` measures it with the rates).
      progress: called with (configurations tried, configurations in all)
        before each and once at the end (each builds a pipeline and
        compiles what is new of its backward: seconds each).
    """
    if devices < 1 or batch < 1:
        raise ConfigError(f"devices={devices}, batch={batch}; both must be positive")
    unknown = [n for n in schedules or () if n not in FAMILIES]
    if unknown or not set(remat) <= {"stage", "none"}:
        raise ConfigError(f"search over schedules {unknown or list(schedules)}, remat "
                          f"{list(remat)}: use schedules from {', '.join(names())} and remat "
                          f"'stage' or 'none'")
    Ks = list(stages or [k for k in _divisors(devices) if k <= len(layers)])
    layouts = [(K, F, T) for K in Ks for F in fsdp for T in tensor
               if devices % (K * F * T) == 0]
    for K in Ks if stages else ():  # a stage count given must fit the devices with some F, T
        if all(k != K for k, _, _ in layouts):
            inner = [(name, list(n)) for name, n in (("fsdp", fsdp), ("tensor", tensor))
                     if list(n) != [1]]
            over = "".join(f" x {name} in {n}" for name, n in inner)
            into = " x ".join(["data", "stages", *(name for name, _ in inner)])
            raise ConfigError(f"stages={K}{over} does not divide devices={devices}; the search "
                              f"splits them into {into}")
    most = max((K * F * T for K, F, T in layouts), default=0)
    if most > len(jax.devices()):
        raise DeviceError(f"stages x fsdp x tensor = {most} devices but JAX sees "
                          f"{len(jax.devices())}; on CPU call pj.simulate_devices({devices}) "
                          "before JAX starts, or pass fewer stages")
    optimizer = optimizer or optax.sgd(0.1, momentum=0.9)
    searched = [n for n, f in FAMILIES.items() if f.searched]
    tries = []  # (K, F, T, replicas, M, schedule, remat, compute dtype)
    for K, F, T in layouts:
        R = devices // (K * F * T)
        if batch % R:
            continue
        per_replica = batch // R
        Ms = microbatches or [m for m in (K * 2 ** i for i in range(8))
                              if m <= per_replica and per_replica % m == 0][:4]
        tries += [(K, F, T, R, *c) for c in itertools.product(Ms, schedules or searched, remat,
                                                               compute_dtypes)
                  if per_replica % (c[0] * F) == 0]
    out = []
    for i, (K, F, T, R, M, name, rm, dtype) in enumerate(tries):
        if progress is not None:
            progress(i, len(tries))
        v = FAMILIES[name].search_virtual
        mb = batch // R // M
        stack = lambda a: jnp.zeros((mb, *np.shape(a)), jnp.result_type(a))
        try:
            pipe = pipeline(layers, loss=loss, example=jax.tree.map(stack, example),
                            targets=None if targets is None else jax.tree.map(stack, targets),
                            stages=K, microbatches=M, schedule=name, virtual=v, remat=rm,
                            compute_dtype=dtype, partition=partition,
                            mesh=make_mesh(K, fsdp=F, tensor=T) if F * T > 1 else None)
        except (ConfigError, LayerError) as err:
            if isinstance(err, LayerError) and T == 1:
                shapes = ", ".join(str(np.shape(a)) for a in jax.tree.leaves(example))
                raise LayerError(f"{err} (pj.search stacked {mb} of example {shapes} into "
                                 "each micro-batch: give one example, without its batch "
                                 "axis)") from None
            continue  # this table does not take these settings (M < K, v·K > layers, T
            # that no annotation or not every annotated axis takes, ...)
        if crossing(pipe.build):
            continue  # its step would hang on a collective in a stage's branch (e.g. T
            # splitting attention heads)
        out.append(_candidate(pipe, name, R, v, M, mb, rm, dtype, optimizer, learning_rate,
                              momentum, reference, device_flops, link_bandwidth,
                              tick_seconds, host_flops, memory_bandwidth, layer_seconds))
    if progress is not None:
        progress(len(tries), len(tries))
    if memory is not None and out and min(c.memory_bytes for c in out) > memory:
        raise ConfigError(f"no candidate fits memory={human_bytes(memory)} a device: the "
                          f"smallest needs {human_bytes(min(c.memory_bytes for c in out))}; "
                          f"allow more, or add devices, remat or a smaller batch")
    if memory is not None:
        out = [c for c in out if c.memory_bytes <= memory]
    return sorted(out, key=lambda c: (c.stable is False, c.step_seconds, c.memory_bytes))


def _candidate(pipe: Pipeline, name: str, R: int, v: int, M: int, mb: int, rm: str, dtype,
               optimizer, learning_rate, momentum, reference, device_flops, link_bandwidth,
               tick_seconds, host_flops, memory_bandwidth, layer_seconds) -> Candidate:
    """What `pipe` (one replica of R) is predicted to cost."""
    schedule, plan = pipe.schedule, pipe.plan
    flops = [sum(s.flops or 0.0 for s in plan.stage_specs(j)) for j in range(plan.chunks)]
    code = pipe.build.code
    share = w_shares(code, flops) if code.splits else None
    remat, fused = rm != "none", bool(schedule.fused.any())
    costs = op_costs(flops, remat, fused, share, code.deferred)
    params, F, T = pipe.layout.pieces.slot_bytes(), pipe.build.F, pipe.layout.params.parts
    if T > 1:
        costs = split_costs(pipe, costs, remat, device_flops / link_bandwidth)
    moved = ring_costs(pipe, device_flops / memory_bandwidth)
    fixed = fixed_costs(code, remat, fused, layer_seconds * device_flops)
    costs = {op: cost + moved[op] + fixed[op] for op, cost in costs.items()}
    sends = int((carried(schedule) * buffers(schedule)).sum())  # buffers the collectives send
    message = sends * pipe.layout.acts.slot_bytes() / link_bandwidth
    allreduce = 2 * (R - 1) / R * params / link_bandwidth if R > 1 else 0.0
    shared = None if host_flops is None else host_flops / (R * F * T)  # all devices share it
    step = step_seconds(schedule, costs, device_flops, tick_seconds, shared) + message
    step += allreduce * (schedule.ticks if schedule.asynchronous else 1)
    if F > 1:  # gathers and scatters of the whole stage, (F − 1)/F of it over the link each
        once = (F - 1) * params / link_bandwidth
        ticks = busy_ticks(schedule, (Op.F, Op.B, Op.W, Op.BW)) + busy_ticks(
            schedule, (Op.BW, Op.W)) if pipe.build.gather == "tick" else 2
        step += once * ticks
    # An update's examples over the replicas: a micro-batch of each (PB, PipeDream) or a step.
    update = M * mb * R // schedule.updates_per_step
    delay = effective_delay(schedule, update, learning_rate, momentum, reference)
    return Candidate(
        schedule=name, stages=pipe.K, data=R, fsdp=F, tensor=T, virtual=v, microbatches=M,
        microbatch=mb,
        remat=rm, compute_dtype=str(np.dtype(dtype)) if dtype is not None else "float32",
        step_seconds=step, memory_bytes=_memory_bytes(pipe, optimizer, R),
        bubble=table_bubble_fraction(schedule), effective_delay=delay,
        stable=None if delay is None else delay <= STABLE_DELAY,
        advice=advise(delay, update, reference))


def _memory_bytes(pipe: Pipeline, optimizer, R: int) -> int:
    """The predicted peak bytes per device of `pipe`'s trainer on R replicas.
    `pipe` is one replica, on a mesh without the data axis, whose trainer
    has no data rule; on R > 1 the trainer runs SSGD's mean around the
    stage chains (`Outer.collective`), which holds other buffers."""
    trainer = pipe.trainer(optimizer)
    if R == 1:
        return trainer.memory().total
    opts = trainer.optimizers
    outer = dataclasses.replace(opts.outer, rule=ssgd())
    return estimate(pipe.build, dataclasses.replace(opts, outer=outer)).total


def render(candidates: Sequence[Candidate], limit: int = 20) -> str:
    """The ranked candidates as a table."""
    rows = [["#", "schedule", "K x R x F x T", "v", "M x mb", "remat", "dtype", "step", "memory",
             "bubble", "delay", "advice"]]
    for i, c in enumerate(candidates[:limit]):
        delay = "?" if c.effective_delay is None else f"{c.effective_delay:.3g}"
        rows.append([str(i), c.schedule, f"{c.stages} x {c.data} x {c.fsdp} x {c.tensor}",
                     str(c.virtual),
                     f"{c.microbatches} x {c.microbatch}", c.remat, c.compute_dtype,
                     f"{c.step_seconds * 1e3:.3g} ms", human_bytes(c.memory_bytes),
                     f"{c.bubble:.2f}", delay, c.advice])
    return table(rows)
