"""The step-time model `pj.search` ranks by: each op's cost on each virtual
stage in FLOPs (its arithmetic, its ring traffic, a tensor split's share
and all-reduces, its layers' fixed cost, all at the device's rate), and
the table's ticks as the devices run them (paths.py). The planner's
docstring lists its assumptions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np

from pipejax.compile import split_functions, tensor_share
from pipejax.planner.paths import coupled_path, critical_path, executed
from pipejax.schedules import Op, Schedule
from pipejax.trace import nbytes, xla_flops

if TYPE_CHECKING:
    from pipejax.compile import StageCode
    from pipejax.pipeline import Pipeline


def op_costs(chunk_flops: Sequence[float], remat: bool, fused: bool = False,
             w_share: Sequence[float] | None = None, deferred: bool = False) -> dict:
    """FLOPs of each op on each virtual stage from its forward + backward
    FLOPs (the 1 : 2 split; a rematerialized backward recomputes its
    forward, but on the last stage where it runs with its forward as one
    vjp (compile/last_stage.py): a `fused` pair in one tick, or a backward
    (B or BW) that runs the forward (`deferred`), whose forward then costs
    nothing at its own tick); W does `w_share` of the backward
    (`w_shares`; default half) and B the rest."""
    forward = np.asarray(chunk_flops, float) / 3
    again, own = forward * remat, forward.copy()
    if fused:
        again[-1] = 0.0  # the pair's one vjp replays nothing
    if deferred:  # the backward runs the forward itself, not a replay of it
        again[-1], own[-1] = forward[-1], 0.0
    w = 2 * forward * (0.5 if w_share is None else np.asarray(w_share, float))
    return {Op.F: own, Op.BW: 2 * forward + again, Op.B: 2 * forward - w + again, Op.W: w}


def w_shares(code: StageCode, chunk_flops: Sequence[float]) -> np.ndarray:
    """W's share of each virtual stage's backward, B's replay of the forward
    under remat left out (a third of `chunk_flops`, as `op_costs` counts
    it): XLA's count of W over B's and W's as the zero-bubble split runs
    them, each lowered alone, once per process for equal stages. Not half:
    on the zoo GPT 6x64 at K = 4, W does 0.42 of a stage's backward, B the
    input gradients and the attention's chain. A lock-step tick waits for
    its slowest op, so the share moves the step of devices of their own;
    devices that share one processor run the same total either way."""
    replay = code.model.remat != "none"

    def share(j: int) -> float:
        b, w = (xla_flops(jax.jit(fn).lower(*args)) for fn, args in split_functions(code, j))
        whole = None if b is None or w is None else b + w - replay * chunk_flops[j] / 3
        return w / whole if whole and whole > 0 else 0.5

    return np.array([code.remembered(j, ("w share", code.model.remat), lambda j=j: share(j))
                     for j in range(code.S)])


def fixed_costs(code: StageCode, remat: bool, fused: bool, layer_flops: float) -> dict:
    """FLOPs of each op on each virtual stage that count its fixed cost,
    what it spends whatever its micro-batch's size (the launch and dispatch
    of its kernels): `layer_flops` (a layer's forward's fixed seconds at the
    device's rate) for each layer of the chunk, in `op_costs`' 1 : 2 split
    (B and W one each; a replayed forward again). What it adds grows with
    the micro-batches, not the FLOPs: `benchmarks/planner.py --part time`
    measures it (the GPT 6x64 at K = 1, its batch in 1 and in 16
    micro-batches) and reports the timed steps' errors with and without it."""
    layers = np.array([len(code.plan.stage_specs(j)) for j in range(code.S)], float)
    return op_costs(3 * layer_flops * layers, remat, fused, None, code.deferred)


def ring_costs(pipe: Pipeline, flops_per_byte: float) -> dict:
    """FLOPs of each op on each virtual stage that count its ring traffic
    (`flops_per_byte`: the device's FLOP rate over its memory's byte rate):
    a forward writes its kept residuals (none under remat "stage"), the
    backward that takes them (BW; B and W) reads them back; B writes the
    bridge and W reads it. A row is padded to the largest stage, so every
    chunk moves a whole one; a fused last stage keeps nothing. A value that
    goes through a ring is written and read again where the fused vjp of a
    plain jit uses it where it is made (`benchmarks/planner.py --part time`
    reports the timed steps' errors with and without this term)."""
    code = pipe.build.code
    kept = np.full(code.S, float(code.kept.slot_bytes()))
    if pipe.schedule.fused.any():
        kept[-1] = 0.0
    bridge = np.full(code.S, float(code.bridge.slot_bytes() if code.bridge else 0))
    moved = {Op.F: kept, Op.BW: kept, Op.B: kept + bridge, Op.W: kept + bridge}
    return {op: flops_per_byte * b for op, b in moved.items()}


def step_seconds(schedule: Schedule, costs: dict, device_flops: float, per_tick: float,
                 host_flops: float | None = None) -> float:
    """Seconds of the table's ticks at `device_flops`, plus `per_tick` a
    tick (its fixed cost). Devices of their own (processes, GPUs) run as
    the collectives couple them (`paths.coupled_path`: a
    device that receives at a tick waits for its senders to end it);
    devices that share one processor (`host_flops`: simulated CPU devices
    in one process, whose collectives are a rendezvous of every device
    they name) in lock step (`critical_path`), and at least every op of
    the table over `host_flops`."""
    if host_flops is None:
        compute = coupled_path(schedule, costs) / device_flops
    else:
        compute = max(critical_path(schedule, costs) / device_flops,
                      executed(schedule, costs) / host_flops)
    return compute + schedule.ticks * per_tick


def split_costs(pipe: Pipeline, costs: dict, remat: bool, flops_per_byte: float) -> dict:
    """`costs` of a pipeline whose stages are split over T tensor devices:
    each chunk's FLOPs with its split share over T, plus its all-reduces
    of activations (Megatron: one per matrix that takes a split input in
    the forward, one more in the backward, and the forward's again when
    rematerialized), 2(T − 1)/T of the activation after the chunk's first
    layer over the link each, counted as the FLOPs of that time
    (`flops_per_byte`: the device's rate over the link's)."""
    code, T = pipe.build.code, pipe.build.stage.tensor
    shares = [tensor_share(code, j) for j in range(code.S)]
    scale = np.array([1 - share + share / T for share, _ in shares])
    reduce = np.array([rows * 2 * (T - 1) / T * nbytes(code.plan.stage_specs(j)[0].output)
                       for j, (_, rows) in enumerate(shares)]) * flops_per_byte
    extra = {Op.F: reduce, Op.B: reduce * (1 + remat), Op.BW: reduce * (1 + remat),
             Op.W: np.zeros_like(reduce)}
    return {op: cost * scale + extra[op] for op, cost in costs.items()}
