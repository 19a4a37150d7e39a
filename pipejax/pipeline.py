"""`pj.pipeline`: a layer list compiled for a stage mesh, as an immutable description.

layer list ─trace→ LayerSpec[] ─partition→ Plan ─schedule→ Table ─compile→ programs

A `Pipeline` holds what every step of the data flow produced and the
programs that need no optimizer (`init`, `value_and_grad`);
`pipe.trainer(optimizer)` binds an optimizer and compiles the training step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pipejax import checks as valid  # `checks` is pj.pipeline's flag
from pipejax.checks import Remat
from pipejax.compile import (Build, Flags, Model, PipelinePrograms, Shapes, Staged,
                             check_params, check_table, compile_build, id_ranges, key_or_default,
                             pipeline_programs, stage_rows)
from pipejax.errors import BatchError, ConfigError
from pipejax.layers import Layer, abstract, layer_list
from pipejax.layers.ties import leaf_ties
from pipejax.mesh import stage_mesh
from pipejax.partition import make_plan
from pipejax.schedules import Schedule, capacities, make_schedule, placement_for
from pipejax.stage_layout import Gather, StageLayout
from pipejax.trace import trace, trace_loss
from pipejax.trainer import Trainer
from pipejax.transforms.data_parallel import DataRule
from pipejax.transforms.per_stage import Optimizer


def _describe(tree: Any) -> str:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return "{" + ", ".join(f"{jax.tree_util.keystr(p)}: {jnp.result_type(a)}{list(np.shape(a))}"
                           for p, a in leaves) + "}"


@dataclasses.dataclass(frozen=True, eq=False)
class Pipeline:
    """A layer list compiled for a stage mesh. Build it with `pj.pipeline`.

    It holds the `Build` every program is made from (placement, stage code,
    schedule, layout, mesh) and the programs that need no optimizer;
    `plan`, `specs`, `schedule`, `layout`, `mesh`, `layers`, `K` and `M` are
    read off the build."""

    build: Build
    programs: PipelinePrograms
    shapes: Shapes  # the builds at every micro-batch shape met so far (compile/shapes.py)

    plan = property(lambda self: self.build.code.plan, doc="Which layers each stage holds (Plan).")
    specs = property(lambda self: self.plan.specs, doc="The traced layers (LayerSpecs), in order.")
    schedule = property(lambda self: self.build.schedule, doc="The schedule table.")
    layout = property(lambda self: self.build.layout, doc="Buffers and their bytes (Layout).")
    mesh = property(lambda self: self.build.mesh, doc="The stage mesh.")
    layers = property(lambda self: tuple(layer.source for layer in self.build.code.model.layers),
                      doc="The layer list, as given (its modules and functions).")
    K = property(lambda self: self.build.K, doc="Pipeline stages.")
    M = property(lambda self: self.build.M, doc="Micro-batches per step (of each replica).")

    random_layers = property(lambda self: self.plan.random_layers,
                             doc="The layers that draw random numbers when training (dropout).")

    # ---------------------------------------------------------------- params
    def init(self, key: jax.Array | None = None) -> Staged:
        """Parameters, each stage's on its own device. A linen layer i is
        initialized by Flax with fold_in(key, i), so the values do not depend
        on K; an NNX layer arrives initialized: its current parameters (as
        `nnx.state(layer, nnx.Param)` gives them now) are placed on its stage.
        `key` may be left out when no linen layer has parameters. To start an
        NNX model from another key, build its modules again with
        `nnx.Rngs(key)`."""
        initial = [layer.initial_values() for layer in self.build.code.model.layers]
        keyed = [s for s in self.specs if s.param_bytes and initial[s.index] is None]
        if keyed and key is None:
            names = ", ".join(f"{s.index} ({s.name})" for s in keyed[:4])
            raise ConfigError(f"layers {names} are initialized from a key: pass pipe.init a key, "
                              "e.g. jax.random.key(0)")
        self._check_variables(initial)
        return self.programs.init(jax.random.key(0) if key is None else key)

    def stage(self, variables: Sequence[dict]) -> Staged:
        """Stage one variables dict per layer (the inverse of `pj.unstage`)."""
        if len(variables) != len(self.layers):
            raise ConfigError(f"got {len(variables)} variables dicts for {len(self.layers)} layers; "
                              "give one per layer, as pj.unstage returns them")
        self._check_variables(variables)
        return stage_rows(self.build, variables.__getitem__)

    def _check_variables(self, variables: Sequence[Any]) -> None:
        """Raise unless each given variables dict (None: not given) has the
        structure, shapes and dtypes of its layer's when the pipeline was built."""
        for spec, v in zip(self.specs, variables):
            if v is None:
                continue
            want, got = abstract(spec.variables), abstract(v)
            if jax.tree.structure(want) != jax.tree.structure(got) or want != got:
                raise ConfigError(f"layer {spec.index} ({spec.name}) has variables {_describe(want)} "
                                  f"but was given {_describe(got)}")

    # ------------------------------------------------------------- programs
    def value_and_grad(self, params: Staged, batch: tuple,
                       key: jax.Array | None = None) -> tuple[jax.Array, Staged]:
        """Mean loss over the micro-batches and its gradient (synchronous
        schedules); `batch` = (x, y) with M micro-batches stacked. Micro-batches
        of another shape than the example's (another sequence length) run a
        program compiled for their shape, once, with this pipeline's partition."""
        if self.programs.value_and_grad is None:
            raise ConfigError(f"value_and_grad needs a synchronous schedule; {self.schedule.name!r} "
                              "updates the weights inside the pipeline: use pipe.trainer(opt).step")
        check_params(self.build, params, "value_and_grad")
        key = key_or_default(self.build, key, "value_and_grad")
        return self.programs.value_and_grad(params, batch, key)

    def trainer(self, optimizer: Optimizer, rule: DataRule | None = None,
                clip_norm: float | None = None, skip_nonfinite: bool = False) -> Trainer:
        """Bind `optimizer` (an optax transform, or StageInfo -> transform) and,
        on a mesh with data axes, the `rule` between replicas (a
        `pj.transforms.DataRule`; default SSGD). `clip_norm` clips the
        gradients by their global norm over all stages before each stage's
        optimizer; `skip_nonfinite` drops (and counts, metric "skipped") an
        update whose loss or gradients are not finite."""
        return Trainer(self.shapes, optimizer, rule, clip_norm, skip_nonfinite)

    def __str__(self) -> str:
        return f"{self.plan}\n{self.layout}"


def pipeline(layers: Sequence[Layer], *, loss: Callable, example: Any, stages: int,
             microbatches: int, targets: Any = None, schedule: str | Schedule = "gpipe",
             partition: str | Sequence[int] = "variance", remat: Remat = "stage",
             mesh: Mesh | None = None, cost: str = "flops", max_bytes: float | None = None,
             weight_stashing: bool = False, share_branches: bool = True,
             compute_dtype: Any = None, max_padding: float | None = None,
             virtual: int | None = None, placement: str | None = None,
             fsdp_gather: Gather | str | None = None, max_shapes: int | None = None,
             checks: bool = False) -> Pipeline:
    """Trace, partition, schedule and compile a layer list for a stage mesh.

    Args:
      layers: the model, a list of Flax linen modules, Flax NNX modules (their
        current values are the initial parameters; layers/nnx.py) or functions of
        one array; or an `nnx.Sequential` / `nnx.List`.
      loss: `loss(outputs, targets)` of ONE micro-batch, returning its mean.
      example: ONE micro-batch of inputs (its shape and dtype matter, not its values).
      stages: K, pipeline stages, one device each.
      microbatches: M, micro-batches per step; a batch stacks M of them.
      targets: ONE micro-batch of targets; default integer class labels `[mb]`.
      schedule: a family's name (`pj.schedules.FAMILIES`: "gpipe", "1f1b",
        "interleaved", "zb-h1", ... and any `pj.schedules.register`ed; each
        says its placement, virtual stages and whether it is asynchronous)
        | a `pj.Schedule` table (built, or read with `pj.Schedule.from_csv`:
        it brings its own virtual and placement).
      partition: "variance" (GPipe: min Σ_k C_k²) | "bottleneck" (PipeDream:
        min max_k C_k) | a list of layer counts per (virtual) stage.
      remat: "stage" (keep stage inputs only, recompute the forward in the
        backward) | "none" | a `jax.checkpoint` policy.
      mesh: a mesh with a "stage" axis of K devices and optional data axes,
        one pipeline replica per data index (`pj.make_mesh(K, data, nodes)`:
        ("data", "stage") or ("node", "local", "stage")); a batch then holds
        R·M micro-batches, replica-major. An "fsdp" axis of F devices
        (`pj.make_mesh(K, fsdp=F)`) shards each stage over F devices: its
        parameters, gradients and optimizer state in F pieces, each
        micro-batch in F parts (`example` is still the whole micro-batch).
        Default: the first K devices.
      cost: what the partitioner balances: "flops" (XLA's estimate) or "time"
        (each layer measured).
      max_bytes: the partitioner keeps every stage's parameters with their
        gradient and two optimizer moments, plus the activations it stashes for
        its micro-batches in flight (the schedule's count), within this many bytes
        (on stages sharded over F devices: still the whole stage's
        parameters, gradient and moments, what a device holds while it runs
        the stage's ops is at most that).
      max_padding: keep the packed parameters' padding (every device holds the
        largest stage's slots) within this fraction of their bytes, e.g.
        0.25, giving up as little cost balance as the partitioner can.
      weight_stashing: asynchronous schedules only: a backward uses the weights
        its forward used (PipeDream), at the memory `pipe.layout` reports.
      share_branches: stages of identical structure share one branch of the
        stage switch (compile time flat in depth); False compiles one branch
        per stage, what `pipejax bench` compares against.
      compute_dtype: the dtype the stages compute in, e.g. `jnp.bfloat16`:
        float32 weights are cast to it inside each stage (master weights,
        gradients and optimizer state stay float32), boundary activations
        and their gradients travel in it, the loss is float32. Layers with
        their own Flax `dtype` keep it. Default None: as stored.
      virtual: v, model chunks per device (interleaved virtual stages,
        Narayanan et al. 2021): the list is split into K·v chunks; a
        micro-batch visits the devices v times and the fill/drain bubble
        shrinks to (K−1)/(v·M+K−1). Synchronous schedules only. Default:
        the table's (a `pj.Schedule`), else the family's `virtual`.
      placement: which chunks a device holds (`pj.Placement`): "loop" (device
        k holds chunks k, k + K, ...) or "v" (chunks k and 2K − 1 − k: the
        first and last chunks share device 0). Default: the table's, else
        the family's, the only one it runs.
      fsdp_gather: where a stage sharded over an "fsdp" axis gathers its
        weights: "tick" (at every tick that uses them, its gradients
        scattered to the pieces op by op: the least memory) or "step" (once
        per step, before the pass, and the gradient sum scattered once after
        it: one gather a step, the whole weights and gradient sum held for
        it; synchronous schedules). Default None: "tick".
      max_shapes: at most this many micro-batch shapes (the example's
        included) that `trainer.step` and `value_and_grad` compile a program
        for, as `jax.jit` compiles one per shape: a batch whose axes after the
        batch axis differ from the example's (another sequence length) is
        traced at its shape with this pipeline's partition and runs on the
        same parameters and state (synchronous schedules). Default None: no
        bound.
      checks: check every batch's integer inputs and targets against their
        range before the step (token ids below the first layer's embedding
        table's rows, targets below the output's last axis, none negative),
        raising a `BatchError` that names them instead of a NaN loss or a
        silent wrap; one device-to-host read a step (compile/ids.py).

    Returns:
      An immutable `Pipeline`: `.plan`, `.schedule`, `.layout`, `.init(key)`,
      `.value_and_grad(params, batch, key)`, `.trainer(optimizer)`.
    """
    shared: list = []  # modules two layers hold: tied weights
    layers = layer_list(layers, shared)
    placement = placement_for(schedule, stages, virtual, placement)
    valid.counts(layers, placement, microbatches)
    remat = valid.remat(remat)
    compute_dtype = valid.dtype(compute_dtype)
    table = make_schedule(schedule, placement, microbatches)
    check_table(table)
    valid.staleness(table, remat, weight_stashing)
    mesh = stage_mesh(stages, mesh)
    example = abstract(example)
    mb = jax.tree.leaves(example)[0].shape[0]
    targets = abstract(jnp.zeros((mb,), jnp.int32) if targets is None else targets)
    # A stage sharded over F devices runs one F-th of each micro-batch on each.
    stage = StageLayout.of(mesh, fsdp_gather, table)
    example, targets = valid.sharded(stage.fsdp, example, targets)
    specs = tuple(trace(list(layers), example, cost=cost))
    trace_loss(loss, specs[-1].output, targets)
    ties = leaf_ties(shared, [s.variables for s in specs], [s.name for s in specs])
    valid.ties(ties, specs, table)
    in_flight = [capacities.in_flight(table, k) for k in range(stages)] if max_bytes else None
    plan = make_plan(specs, placement, partition, max_bytes, in_flight=in_flight,
                     keeps_activations=remat == "none", max_padding=valid.padding(max_padding))
    model = Model(tuple(layers), loss, remat, example, targets, compute_dtype, ties)
    flags = Flags(weight_stashing, share_branches, stage)
    b = compile_build(model, plan, table, mesh, flags)
    shapes = Shapes(b, lambda x, y: _at_shape(b, flags, x, y), max_shapes,
                    id_ranges(specs, example, targets) if checks else None)
    return Pipeline(b, pipeline_programs(shapes), shapes)


def _at_shape(b: Build, flags: Flags, example: Any, targets: Any) -> Build:
    """`b` traced again at micro-batches `example` and `targets` (one
    device's part), with its partition, table, mesh and flags.

    Raises:
      BatchError: naming the first layer whose parameters differ at this shape.
    """
    model = b.code.model._replace(example=example, targets=targets)
    arrays = lambda tree: ", ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(tree))
    specs = tuple(trace(list(model.layers), example, source=(
        f"a batch of other micro-batches than the pipeline's {arrays(b.example)} (a language "
        "model takes windows up to its context)")))
    trace_loss(model.loss, specs[-1].output, targets)
    for old, new in zip(b.code.plan.specs, specs):
        if abstract(old.variables) != abstract(new.variables):
            raise BatchError(
                f"micro-batches of inputs {arrays(example)} give layer {new.index} ({new.name}) "
                f"variables {_describe(new.variables)}, but the pipeline was built for "
                f"micro-batches {arrays(b.example)}, where it has {_describe(old.variables)}: its "
                "parameters depend on the input's shape, so one state cannot train both; give "
                f"micro-batches of {arrays(b.example)} (pad sequences: pj.data.pad_to_lengths)")
    plan = make_plan(specs, b.placement, list(b.code.plan.split))
    return compile_build(model, plan, b.schedule, b.mesh, flags)
