"""`pj.search`: build each configuration a `Space` holds for a `Machine`
and a `Training`, cost it, and rank them (the package's docstring says how)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.compile import buffers, carried, crossing, estimate
from pipejax.errors import ConfigError, DeviceError, LayerError
from pipejax.formatting import human_bytes
from pipejax.mesh import make_mesh
from pipejax.pipeline import Pipeline, pipeline
from pipejax.planner.candidate import Candidate
from pipejax.planner.costs import (fixed_costs, op_costs, ring_costs, split_costs, step_seconds,
                                   w_shares)
from pipejax.planner.machine import Machine
from pipejax.planner.paths import busy_ticks
from pipejax.planner.space import Space, Training, Try
from pipejax.schedules import FAMILIES, Op
from pipejax.schedules.bubbles import table_bubble_fraction
from pipejax.stage_layout import Gather
from pipejax.staleness import STABLE_DELAY, advise, effective_delay
from pipejax.transforms.data_parallel import ssgd


def search(layers: Sequence, *, loss: Callable, example: Any, targets: Any = None,
           machine: Machine, training: Training, space: Space = Space(),
           progress: Callable[[int, int], None] | None = None) -> list[Candidate]:
    """The configurations of `layers` in `space` for `training`'s batch on
    `machine`'s devices, best first: stable (or unknown) before unstable,
    then by predicted step time, then memory.

    Args:
      layers, loss: as `pj.pipeline` takes them.
      example: ONE example's inputs (no batch axis); the search splits the
        batch into micro-batches. targets: one example's targets (default: an
        integer class label).
      machine: the devices, their memory and rates (`Machine(devices=N)`: N GPUs).
      training: the batch a step takes, the optimizer and its rates.
      space: the settings to try (default: every stage count that divides
        the devices, the searched schedules, remat "stage" and "none").
      progress: called with (configurations tried, configurations in all)
        before each and once at the end (each builds a pipeline and
        compiles what is new of its backward: seconds each).
    """
    N = machine.devices
    layouts = space.layouts(N, len(layers))
    most = max((K * F * T for K, F, T in layouts), default=0)
    if most > len(jax.devices()):
        raise DeviceError(f"stages x fsdp x tensor = {most} devices but JAX sees "
                          f"{len(jax.devices())}; on CPU call pj.simulate_devices({N}) "
                          "before JAX starts, or pass fewer stages")
    tries = space.tries(layouts, N, training.batch)
    out = []
    for i, t in enumerate(tries):
        if progress is not None:
            progress(i, len(tries))
        pipe = _build(layers, loss, example, targets, t, training.batch // t.replicas, space)
        if pipe is None:
            continue
        if crossing(pipe.build):
            continue  # its step would hang on a collective in a stage's branch (e.g. T
            # splitting attention heads)
        out.append(_candidate(pipe, t, machine, training))
    if progress is not None:
        progress(len(tries), len(tries))
    memory = machine.memory
    if memory is not None and out and min(c.memory_bytes for c in out) > memory:
        raise ConfigError(f"no candidate fits memory={human_bytes(memory)} a device: the "
                          f"smallest needs {human_bytes(min(c.memory_bytes for c in out))}; "
                          f"allow more, or add devices, remat or a smaller batch")
    if memory is not None:
        out = [c for c in out if c.memory_bytes <= memory]
    return sorted(out, key=lambda c: (c.stable is False, c.step_seconds, c.memory_bytes))


def _build(layers: Sequence, loss: Callable, example: Any, targets: Any, t: Try,
           per_replica: int, space: Space) -> Pipeline | None:
    """The pipeline of `t` at `per_replica` examples a step, or None where
    its table does not take these settings (M < K, v·K > layers, a T that
    no annotation or not every annotated axis takes, ...)."""
    mb = per_replica // t.microbatches
    stack = lambda a: jnp.zeros((mb, *np.shape(a)), jnp.result_type(a))
    F, T = t.fsdp, t.tensor
    try:
        return pipeline(layers, loss=loss, example=jax.tree.map(stack, example),
                        targets=None if targets is None else jax.tree.map(stack, targets),
                        stages=t.stages, microbatches=t.microbatches, schedule=t.schedule,
                        virtual=FAMILIES[t.schedule].search_virtual, remat=t.remat,
                        compute_dtype=t.compute_dtype, partition=space.partition,
                        mesh=make_mesh(t.stages, fsdp=F, tensor=T) if F * T > 1 else None)
    except (ConfigError, LayerError) as err:
        if isinstance(err, LayerError) and T == 1:
            shapes = ", ".join(str(np.shape(a)) for a in jax.tree.leaves(example))
            raise LayerError(f"{err} (pj.search stacked {mb} of example {shapes} into "
                             "each micro-batch: give one example, without its batch "
                             "axis)") from None
        return None


def _candidate(pipe: Pipeline, t: Try, machine: Machine, training: Training) -> Candidate:
    """What `pipe` (one replica of `t.replicas`) is predicted to cost."""
    m, R, M = machine, t.replicas, t.microbatches
    schedule, plan, code = pipe.schedule, pipe.plan, pipe.build.code
    flops = [sum(s.flops or 0.0 for s in plan.stage_specs(j)) for j in range(plan.chunks)]
    share = w_shares(code, flops) if code.splits else None
    remat, fused = t.remat != "none", bool(schedule.fused.any())
    costs = op_costs(flops, remat, fused, share, code.deferred)
    params, F, T = pipe.layout.pieces.slot_bytes(), pipe.build.stage.fsdp, pipe.build.stage.tensor
    if T > 1:
        costs = split_costs(pipe, costs, remat, m.device_flops / m.link_bandwidth)
    moved = ring_costs(pipe, m.device_flops / m.memory_bandwidth)
    fixed = fixed_costs(code, remat, fused, m.layer_seconds * m.device_flops)
    costs = {op: cost + moved[op] + fixed[op] for op, cost in costs.items()}
    sends = int((carried(schedule) * buffers(schedule)).sum())  # buffers the collectives send
    message = sends * pipe.layout.acts.slot_bytes() / m.link_bandwidth
    allreduce = 2 * (R - 1) / R * params / m.link_bandwidth if R > 1 else 0.0
    shared = None if m.host_flops is None else m.host_flops / (R * F * T)  # all devices share it
    step = step_seconds(schedule, costs, m.device_flops, m.tick_seconds, shared) + message
    step += allreduce * (schedule.ticks if schedule.asynchronous else 1)
    if F > 1:  # gathers and scatters of the whole stage, (F − 1)/F of it over the link each
        once = (F - 1) * params / m.link_bandwidth
        ticks = busy_ticks(schedule, (Op.F, Op.B, Op.W, Op.BW)) + busy_ticks(
            schedule, (Op.BW, Op.W)) if pipe.build.stage.gather is Gather.TICK else 2
        step += once * ticks
    # An update's examples over the replicas: a micro-batch of each (PB, PipeDream) or a step.
    mb = training.batch // R // M
    update = M * mb * R // schedule.updates_per_step
    delay = effective_delay(schedule, update, training.learning_rate, training.momentum,
                            training.reference)
    optimizer = training.optimizer or optax.sgd(0.1, momentum=0.9)
    return Candidate(
        schedule=t.schedule, stages=pipe.K, data=R, fsdp=F, tensor=T,
        virtual=FAMILIES[t.schedule].search_virtual, microbatches=M, microbatch=mb,
        remat=t.remat,
        compute_dtype=str(np.dtype(t.compute_dtype)) if t.compute_dtype is not None else "float32",
        step_seconds=step, memory_bytes=_memory_bytes(pipe, optimizer, R),
        bubble=table_bubble_fraction(schedule), effective_delay=delay,
        stable=None if delay is None else delay <= STABLE_DELAY,
        advice=advise(delay, update, training.reference, FAMILIES[t.schedule].mitigation))


def _memory_bytes(pipe: Pipeline, optimizer: optax.GradientTransformation, R: int) -> int:
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
