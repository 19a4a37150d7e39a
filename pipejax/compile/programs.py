"""The front door of the compiler: what `pj.pipeline` and a trainer need.

`Pipeline` and `Trainer` import this module and nothing else of compile/.
It checks a table the executor must run, makes the `Build` (the last stage's vjp
seed, whether backwards are split into B and W) and compiles the programs
on it: `pipeline_programs` (value_and_grad) and `train_programs` (an
optimizer's init, step and flush), each jitted, placed on the mesh and
behind the CPU dispatch guard. Parameters are initialized layer by layer
(`initial_params`, each layer's own program) and placed by `stage_rows`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pipejax.compile import asynchronous, synchronous
from pipejax.compile.build import Build
from pipejax.compile.guard import guarded
from pipejax.compile.rendezvous import Checked, applies
from pipejax.compile.ids import ranges as id_ranges
from pipejax.compile.lanes import compiled_lanes
from pipejax.compile.layout import Layout
from pipejax.compile.memory import MemoryEstimate, estimate
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.pieces import states as opt_states
from pipejax.compile.outer import Outer
from pipejax.compile.spmd import REPLICATED, params, per_device, sharding
from pipejax.compile.shapes import PerShape, Shapes
from pipejax.compile.last_stage import backwards
from pipejax.compile.model import Model
from pipejax.compile.stages import StageCode
from pipejax.compile.tensor import crossing_lines, kept_packing, slot_shardings
from pipejax.compile.ties import initial
from pipejax.compile.versions import Versions
from pipejax.compile.state import InFlight, Rings, Staged, TrainState, unstage
from pipejax.errors import ArgumentTypeError, ConfigError
from pipejax.layers import layer_variables
from pipejax.partition import Plan
from pipejax.schedules import Schedule
from pipejax.stage_layout import StageLayout
from pipejax.transforms.data_parallel import DataRule
from pipejax.transforms.per_stage import Optimizer

__all__ = ["Build", "Flags", "MemoryEstimate", "Model", "PipelinePrograms", "StageOptimizers",
           "Shapes", "Staged", "TrainPrograms", "TrainState", "build", "check_params",
           "check_table", "crossing", "id_ranges", "key_or_default", "opt_states",
           "pipeline_programs", "stage_rows", "train_programs", "unstage"]


class Flags(NamedTuple):
    """The switches of `pj.pipeline` that the compiled step reads."""

    weight_stashing: bool = False  # an asynchronous backward runs on its forward's weights
    share_branches: bool = True  # stages of one structure share a branch of the switch
    stage: StageLayout = StageLayout()  # a stage's devices, and where its pieces gather


def compile_build(model: Model, plan: Plan, schedule: Schedule, mesh: Mesh, flags: Flags) -> Build:
    """The stage code of `plan`, the layout `schedule` needs and the mesh, as
    one `Build`. The last stage seeds its vjp with 1/M when a step's loss is
    the mean over M micro-batches (one update a step: synchronous,
    double-buffered), 1 when every micro-batch is its own update; a table
    with W ops splits every backward into B and W;
    a synchronous table runs the last stage's forward inside its backward
    where that stage keeps nothing (last_stage.py);
    a stage sharded over F devices packs its slots in F pieces."""
    seed = 1.0 / schedule.microbatches if schedule.updates_per_step == 1 else 1.0
    stage = flags.stage
    code = StageCode(model, plan, seed, flags.share_branches, backwards(schedule), stage)
    code.kept = kept_packing(code, mesh)
    if code.params.tensor > 1 and not any(code.params.tensor_slots):
        raise ConfigError(
            f"the mesh splits each stage over tensor={code.params.tensor} devices, but no layer "
            "annotates a parameter axis with 'tensor': every tensor device would hold and "
            "compute the same; annotate the layers (e.g. nn.Dense(kernel_init="
            "nn.with_partitioning(init, (None, 'tensor')))), or use those devices for fsdp or "
            "data replicas")
    layout = Layout.of(code, schedule, flags.weight_stashing, stage.fsdp)
    return Build(plan.placement, code, schedule, layout, mesh, flags.stage)


def crossing(b: Build) -> tuple[str, ...]:
    """The user's lines where XLA's partitioner would put a collective that
    joins every stage into a stage's code (rendezvous.py), read from each
    stage's code compiled alone; empty where nothing crosses."""
    if not applies(b.mesh):
        return ()
    return tuple(line for j in b.code.groups.first for line in crossing_lines(b.code, j, b.mesh))


def check_table(schedule: Schedule) -> None:
    """Raise unless the executor runs `schedule`: each op kind in one lane,
    its backwards all fused (BW) or all split (B, W)."""
    compiled_lanes(schedule)


class PipelinePrograms(NamedTuple):
    """The programs of a pipeline without an optimizer."""

    init: Callable[[jax.Array], Staged]  # key -> the staged initial variables
    value_and_grad: PerShape | None  # (params, batch, key) -> (loss, grads); None asynchronous


def pipeline_programs(shapes: Shapes) -> PipelinePrograms:
    """The init and (synchronous tables) value_and_grad programs of the
    pipeline's build, value_and_grad at every shape of `shapes`."""
    b = shapes.base
    vg = (PerShape(shapes, lambda at: _program(synchronous.value_and_grad(at), at.mesh,
                                               "value_and_grad"), "value_and_grad")
          if b.schedule.synchronous else None)
    return PipelinePrograms(functools.partial(initial_params, b), vg)


def _program(fn: Callable, mesh: Mesh, where: str, donates: str | None = None,
             **jit: Any) -> Any:
    """`fn` jitted, its compiled program checked for collectives that some
    devices would skip (rendezvous.py), behind the CPU dispatch guard."""
    return guarded(Checked(jax.jit(fn, **jit), mesh, where), mesh, donates)


def initial_params(b: Build, key: jax.Array) -> Staged:
    """Every layer's initial variables (`layer_variables`: linen layer i's
    init with fold_in(key, i), so the values do not depend on K; an NNX
    layer's own values), computed and packed one device at a time on this
    process's default device and moved to that device."""
    specs, layers = b.code.plan.specs, b.code.model.layers
    if len(key.sharding.device_set) > 1:  # a key placed over a mesh: each process inits on its own
        key = key.addressable_shards[0].data

    def variables(i: int) -> Any:
        if not jax.tree.leaves(specs[i].variables):
            return specs[i].variables  # no leaves: the empty tree itself
        return layer_variables(layers[i], specs[i].input, key, i)

    return stage_rows(b, variables)


def stage_rows(b: Build, variables: Callable[[int], Any]) -> Staged:
    """Layer i's variables, `variables(i)`, packed per stage and placed on
    the stage axis, one stage at a time: besides its own, the default device
    holds one other stage's variables and their packed copy at once. A
    sharded stage (over `fsdp` or `tensor`) is packed in host memory and
    each device gets only its piece: no device holds a whole stage it does
    not run. A process places the rows of its own devices (every replica's).
    A tied leaf takes its tie's first holder's value (compile/ties.py)."""
    plan, packing = b.code.plan, b.code.params
    variables = initial(variables, b.code.model.ties)
    placed = slot_shardings(b.mesh, params(b.mesh, replicas=False), packing, 1)
    shapes = [(b.K, *shape) for _, shape in packing.slots]
    where = [s.addressable_devices_indices_map(shape) for s, shape in zip(placed, shapes)]
    shards: list[dict[Any, Any]] = [{} for _ in placed]
    whole = b.F == 1 and packing.tensor == 1
    for k in sorted({idx[0].start or 0 for slot in where for idx in slot.values()}):
        layers = [variables(i) for i in plan.device_layers(k)]
        row = packing.pack(k, layers if whole else jax.device_get(layers))  # numpy: on the host
        for n, slot in enumerate(where):
            for d, idx in slot.items():
                if (idx[0].start or 0) == k:
                    shards[n][d] = jax.device_put(row[n][None][(slice(None), *idx[1:])], d)
    return Staged(tuple(
        jax.make_array_from_single_device_arrays(
            shape, s, [shards[n][d] for d in s.addressable_devices])
        for n, (s, shape) in enumerate(zip(placed, shapes))), packing)


def check_params(b: Build, params: Any, where: str, replicated: bool = True) -> None:
    """Raise unless `params` are the staged parameters of `b` (one copy, or
    with `replicated=False` a trainer's replicas too)."""
    if isinstance(params, Staged) and params.replicas > 1 and replicated:
        raise ArgumentTypeError(f"{where} takes one copy of the parameters; these hold "
                                f"{params.replicas} replicas: pick one with "
                                "pipe.stage(pj.unstage(params, replica=r))")
    if not isinstance(params, Staged):
        raise ArgumentTypeError(f"{where} takes this pipeline's Staged parameters (from "
                                f"pipe.init or pipe.stage), not {type(params).__name__}")
    if params.packing != b.code.params:
        ours, theirs = _partition(b.code.params), _partition(params.packing)
        raise ArgumentTypeError(
            f"{where} got Staged parameters packed for another pipeline ("
            + (f"its layers per device {theirs}, this pipeline's {ours}" if ours != theirs else
               "the same layers per device, other shapes or dtypes")
            + "); move them across with pipe.stage(pj.unstage(params)), then trainer.init")


def _partition(packing: Any) -> list[int]:
    """The layers each device's packed parameter tree holds."""
    return [len(jax.tree_util.treedef_children(t)) for t in packing.treedefs]


def key_or_default(b: Build, key: jax.Array | None, where: str) -> jax.Array:
    """`key`, or key(0) for a model without randomness; a random model needs a key."""
    if key is not None:
        return key
    random = b.code.plan.random_layers
    if random:
        names = ", ".join(f"{s.index} ({s.name})" for s in random[:4])
        raise ConfigError(f"layers {names} draw random numbers when training (dropout); pass "
                          f"{where} a key, e.g. jax.random.key(step), so that every call gets "
                          "fresh masks")
    return jax.random.key(0)


class TrainPrograms(NamedTuple):
    """The programs of one optimizer on one build."""

    optimizers: StageOptimizers
    shardings: TrainState  # where every part of the state lives (a pytree prefix)
    initial: Callable[[bool], Callable]  # replicated -> (params, key) -> TrainState, unjitted
    init: dict  # replicated -> the jitted `initial(replicated)`
    step: Callable  # (state, batch) -> (state, metrics), donating the state
    flush: Callable  # state -> (state, metrics), donating the state
    memory: Callable[[], MemoryEstimate]  # the step's bytes, predicted


def train_programs(shapes: Shapes, optimizer: Optimizer, rule: DataRule | None,
                   clip_norm: float | None, skip_nonfinite: bool) -> TrainPrograms:
    """Bind `optimizer` and the outer pieces (the data rule, the clip, the
    non-finite guard) to the pipeline's build and compile its init, step (at
    every shape of `shapes`, compile/shapes.py) and flush."""
    b = shapes.base
    opts = StageOptimizers.of(optimizer, b, Outer.of(rule, b.mesh, clip_norm, skip_nonfinite))
    if b.schedule.synchronous:
        # A step at another shape fills rings of its own and passes the carried ones through.
        step = lambda at: synchronous.train_step(at, opts, carried=at is b)
        flush = synchronous.flush
    else:
        step, flush = lambda at: asynchronous.train_step(at, opts), asynchronous.flush(b, opts)
    shardings = _shardings(b, opts)
    out = (shardings, sharding(b.mesh, REPLICATED))
    # The state is donated: the new one takes the old one's buffers.
    jitted = lambda fn, name: _program(fn, b.mesh, name, name, out_shardings=out,
                                       donate_argnums=0)
    initial = lambda replicated: _initial(b, opts, replicated)
    init = {r: _program(initial(r), b.mesh, "trainer.init", out_shardings=shardings)
            for r in (True, False)}
    check = lambda where: lambda args: _check_state(b, opts, args[0] if args else None, where)
    return TrainPrograms(opts, shardings, initial, init,
                         PerShape(shapes, lambda at: jitted(step(at), "trainer.step"),
                                  "trainer.step", check=check("trainer.step")),
                         PerShape(shapes, lambda _: jitted(flush, "trainer.flush"),
                                  "trainer.flush", batch=None, check=check("trainer.flush")),
                         lambda: estimate(b, opts))


def _check_state(b: Build, opts: StageOptimizers, state: Any, where: str) -> None:
    """Raise unless `state` is a state of this trainer: its parameters and
    optimizer state packed as this pipeline and optimizer pack them."""
    if not isinstance(state, TrainState):
        raise ArgumentTypeError(f"{where} takes the TrainState that trainer.init or the last "
                                f"step returned, not {type(state).__name__}")
    check_params(b, state.params, where, replicated=False)
    if state.opt_state.packing != opts.packing:
        raise ArgumentTypeError(f"{where} got an optimizer state packed for another optimizer; "
                                "pass the state this trainer's init or step returned")


def _shardings(b: Build, opts: StageOptimizers) -> TrainState:
    """Where each part of a trainer's state lives: a slot split over
    `tensor` (compile/tensor.py) on its tensor devices, column by column."""
    replicated = sharding(b.mesh, REPLICATED)
    device = sharding(b.mesh, per_device(b.mesh))
    rows = Staged(slot_shardings(b.mesh, params(b.mesh), b.code.params, 1), b.code.params)
    state = Staged(slot_shardings(b.mesh, per_device(b.mesh), opts.packing, 1), opts.packing)
    stashed = (slot_shardings(b.mesh, per_device(b.mesh), b.layout.pieces, 2)
               if b.layout.weight_stashing else ())
    kept = slot_shardings(b.mesh, per_device(b.mesh), b.layout.kept, 1)  # rows.shapes
    pieces = slot_shardings(b.mesh, per_device(b.mesh), b.layout.pieces, 1)
    versions = Versions(pieces, pieces, device) if b.layout.versions else ()
    rings = Rings(device, kept, device, stashed, device, versions)
    if b.schedule.asynchronous:
        inflight = InFlight(rings, device, device, replicated, replicated, replicated)
        return TrainState(rows, state, replicated, replicated, inflight, device)
    return TrainState(rows, state, replicated, replicated, None, device, rings)


def _initial(b: Build, opts: StageOptimizers, replicated: bool) -> Callable:
    """`(params, key) -> TrainState`, one program: every part is made on the
    devices that keep it (in a job of several processes too)."""
    init = opts.init_program(b, replicated)

    def initial(params: Staged, key: jax.Array) -> TrainState:
        params, opt_state, rule_state = init(params)
        step = jnp.zeros((), jnp.int32)
        if b.schedule.asynchronous:
            return TrainState(params, opt_state, step, key, asynchronous.init_inflight(b),
                              rule_state)
        return TrainState(params, opt_state, step, key, None, rule_state, synchronous.scratch(b))

    return initial
