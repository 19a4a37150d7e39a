"""`pipe.trainer(optimizer)`: an optimizer bound to a pipeline, in optax's style.

The pipeline is an immutable description; a trainer binds an optax
transformation (or a function `StageInfo -> transformation`) to it and
compiles its own programs, so two trainers of one pipeline are independent.
`init` makes the whole `TrainState`, for an asynchronous schedule its
in-flight part too; `step` and `flush` are jitted, placed so that the state
they return is the state they take, and so run one compiled program from the
first call on; they donate the state they take (its buffers become the new
state's, so parameters and optimizer state are held once): a state passed
to `step` is deleted, and reading it again raises JAX's "Array has been
deleted"; `opt_state` unpacks each stage's optax state.

On a mesh with data axes the trainer holds one replica per data index and a
`DataRule` combines them (`rule=`, default SSGD over every data axis). The
rule is its own argument, not part of the optax chain: the chain runs per
stage inside the stage switch, the rule's collectives around it
(pipejax/transforms/data_parallel.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pipejax.compile import asynchronous, guarded, synchronous
from pipejax.compile.memory import MemoryEstimate, estimate
from pipejax.compile.optimizer import StageOptimizers
from pipejax.compile.outer import Outer
from pipejax.compile.spmd import REPLICATED, per_replica, placement
from pipejax.compile.state import InFlight, Staged, TrainState
from pipejax.errors import ArgumentTypeError, ConfigError
from pipejax.mesh import AXIS, data_axes
from pipejax.transforms.data_parallel import DataRule, ssgd
from pipejax.transforms.per_stage import Optimizer

if TYPE_CHECKING:
    from pipejax.pipeline import Pipeline


def check_rule(rule: DataRule | None, mesh: Mesh) -> DataRule | None:
    """The rule between the replicas of a pipeline on `mesh`: `rule` checked against the
    mesh, SSGD over every data axis by default, None on a mesh without data axes."""
    axes, names = data_axes(mesh), tuple(mesh.axis_names)
    if rule is None:
        return ssgd(axes) if axes else None
    if not isinstance(rule, DataRule):
        raise ArgumentTypeError(f"rule must be a pj.transforms.DataRule (ssgd, adpsgd, hadpsgd, "
                                f"elastic), not {type(rule).__name__}")
    for a in rule.axes:
        if a == AXIS:
            raise ConfigError(f"rule {rule.name!r} names the pipeline axis {AXIS!r}; a data rule "
                              f"combines replicas over the data axes {axes}")
        if a not in names:
            raise ConfigError(f"rule {rule.name!r} names mesh axis {a!r}, but the mesh has axes "
                              f"{names}; build the mesh with that axis (pj.make_mesh(stages, "
                              "data, nodes)) or name one of its data axes")
    unused = [a for a in axes if a not in rule.axes and mesh.shape[a] > 1]
    if unused:
        raise ConfigError(f"rule {rule.name!r} communicates over {rule.axes} but the mesh's data "
                          f"axis {unused[0]!r} ({mesh.shape[unused[0]]} replicas) is in none "
                          "of them: its replicas would train apart; use a rule over every data "
                          "axis (hadpsgd for ('node', 'local'))")
    return rule


class Trainer:
    """`init`, `step`, `flush` and `opt_state` for one optimizer on one pipeline.

    `step(state, (x, y)) -> (state, metrics)` and `flush(state) -> (state,
    metrics)` are jitted (`trainer.step.lower(state, batch).compile()` works)
    and donate `state`: keep the state they return, not the one passed in
    (copy one with `jax.tree.map(jnp.copy, state)` to keep it).
    Metrics: "loss" (mean over the micro-batches the call finished; NaN if
    none), "completed" (how many), "losses" and "microbatch" (each finished
    micro-batch's loss and global id; NaN loss where one did not finish);
    "consensus_distance" under a decentralized rule; with `skip_nonfinite`,
    "skipped": the updates dropped for a non-finite loss or gradient (one
    per step on a synchronous schedule, one per stage and micro-batch on an
    asynchronous one, summed over the replicas).
    """

    def __init__(self, pipe: Pipeline, optimizer: Optimizer, rule: DataRule | None = None,
                 clip_norm: float | None = None, skip_nonfinite: bool = False):
        self.pipeline, self.build = pipe, pipe.build
        self.rule = check_rule(rule, pipe.mesh)
        outer = Outer(self.rule, clip_norm, skip_nonfinite)
        self.optimizers = opts = StageOptimizers.of(optimizer, self.build, outer)
        if pipe.schedule.synchronous:
            step, flush = synchronous.train_step(self.build, opts), synchronous.flush
        else:
            step = asynchronous.train_step(self.build, opts)
            flush = asynchronous.flush(self.build, opts)
        out = (self.shardings, placement(pipe.mesh, REPLICATED))
        # The state is donated: the new one takes the old one's buffers.
        self.step = guarded(jax.jit(step, out_shardings=out, donate_argnums=0), pipe.mesh,
                            "trainer.step")
        self.flush = guarded(jax.jit(flush, out_shardings=out, donate_argnums=0), pipe.mesh,
                             "trainer.flush")
        self._init = {replicated: guarded(jax.jit(self._initial(replicated),
                                                  out_shardings=self.shardings), pipe.mesh)
                      for replicated in (True, False)}

    @property
    def replicas(self) -> int:
        """R, the pipeline replicas the trainer holds (one per data index of the mesh)."""
        return self.build.R

    @property
    def shardings(self) -> TrainState:
        """Where every part of the state lives (a pytree prefix of `TrainState`)."""
        mesh = self.pipeline.mesh
        staged, replicated = placement(mesh, per_replica(mesh)), placement(mesh, REPLICATED)
        inflight = None
        if self.pipeline.schedule.asynchronous:
            inflight = InFlight(staged, staged, staged, replicated, replicated, replicated)
        return TrainState(staged, staged, replicated, replicated, inflight, staged)

    def init(self, params: Staged, key: jax.Array | None = None) -> TrainState:
        """The state before the first step: `params` (from `pipe.init` or
        `pipe.stage`; on a mesh with data axes copied to every replica), each
        stage's optimizer state, the data rule's state, step 0, `key` (needed
        when a layer draws random numbers) and, asynchronous, an empty pipeline."""
        pipe = self.pipeline
        pipe.check_params(params, "trainer.init", replicated=False)
        if params.replicas not in (1, self.replicas):
            raise ConfigError(f"trainer.init got {params.replicas} replicas of the parameters for "
                              f"a mesh of {self.replicas}; give one copy (pipe.init) or "
                              f"{self.replicas}")
        return self._init[params.replicas == 1](params, pipe.key_or_default(key, "trainer.init"))

    def _initial(self, replicated: bool):
        """`(params, key) -> TrainState`, one program: every part is made on
        the devices that keep it (in a job of several processes too)."""
        build, init = self.build, self.optimizers.init_program(self.build, replicated)

        def initial(params: Staged, key: jax.Array) -> TrainState:
            params, opt_state, rule_state = init(params)
            inflight = None
            if build.schedule.asynchronous:
                inflight = asynchronous.init_inflight(build)
            return TrainState(params, opt_state, jnp.zeros((), jnp.int32), key, inflight,
                              rule_state)

        return initial

    def abstract_state(self, params: Staged, key: jax.Array) -> TrainState:
        """The shapes and dtypes of `init(params, key)`, without running it."""
        return jax.eval_shape(self._initial(params.replicas == 1), params, key)

    def memory(self) -> MemoryEstimate:
        """The memory `step` needs per device and per stage, predicted before
        compiling (pipejax/compile/memory.py); print it for a table."""
        return estimate(self.build, self.optimizers.packing)

    def opt_state(self, state: TrainState, replica: int = 0) -> list[Any]:
        """The K per-stage optax states of one replica as ordinary pytrees
        (stage k's over its list of layer variables)."""
        return state.opt_state.per_stage(replica)
