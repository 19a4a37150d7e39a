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

from typing import Any, NamedTuple

import jax

from pipejax.compile import (Build, MemoryEstimate, Shapes, StageOptimizers, Staged, TrainState,
                             check_params, key_or_default, opt_states, train_programs)
from pipejax.errors import ConfigError
from pipejax.packing import Packing
from pipejax.partition import Plan
from pipejax.schedules import Schedule
from pipejax.trace import LayerSpec
from pipejax.transforms.data_parallel import DataRule
from pipejax.transforms.per_stage import Optimizer


class Packings(NamedTuple):
    """How a trainer's state is packed into per-stage buffers."""

    params: Packing
    opt_state: Packing


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
    A batch whose micro-batches are shaped otherwise than the pipeline's
    example (another sequence length) runs a program compiled for its
    shape, once, on the same state (compile/shapes.py; synchronous schedules).
    Build one with `pipe.trainer(optimizer)`.
    """

    def __init__(self, shapes: Shapes, optimizer: Optimizer, rule: DataRule | None = None,
                 clip_norm: float | None = None, skip_nonfinite: bool = False):
        self.build: Build = shapes.base
        self._programs = programs = train_programs(shapes, optimizer, rule, clip_norm,
                                                   skip_nonfinite)
        self.step, self.flush = programs.step, programs.flush

    @property
    def rule(self) -> DataRule | None:
        """The rule between the replicas (None on a mesh without data axes)."""
        return self._programs.optimizers.outer.rule

    @property
    def optimizers(self) -> StageOptimizers:
        """The per-stage optax transforms and the packing of their state (StageOptimizers)."""
        return self._programs.optimizers

    @property
    def replicas(self) -> int:
        """R, the pipeline replicas the trainer holds (one per data index of the mesh)."""
        return self.build.R

    @property
    def specs(self) -> tuple[LayerSpec, ...]:
        """The traced layers, in model order."""
        return self.plan.specs

    @property
    def plan(self) -> Plan:
        """Which layers each stage holds."""
        return self.build.code.plan

    @property
    def schedule(self) -> Schedule:
        """The schedule table."""
        return self.build.schedule

    @property
    def packings(self) -> Packings:
        """How the parameters and the optimizer state are packed per stage."""
        return Packings(self.build.code.params, self.optimizers.packing)

    @property
    def shardings(self) -> TrainState:
        """Where every part of the state lives (a pytree prefix of `TrainState`)."""
        return self._programs.shardings

    def init(self, params: Staged, key: jax.Array | None = None) -> TrainState:
        """The state before the first step: `params` (from `pipe.init` or
        `pipe.stage`; on a mesh with data axes copied to every replica), each
        stage's optimizer state, the data rule's state, step 0, `key` (needed
        when a layer draws random numbers) and, asynchronous, an empty pipeline."""
        check_params(self.build, params, "trainer.init", replicated=False)
        if params.replicas not in (1, self.replicas):
            raise ConfigError(f"trainer.init got {params.replicas} replicas of the parameters for "
                              f"a mesh of {self.replicas}; give one copy (pipe.init) or "
                              f"{self.replicas}")
        key = key_or_default(self.build, key, "trainer.init")
        return self._programs.init[params.replicas == 1](params, key)

    def abstract_state(self, params: Staged, key: jax.Array) -> TrainState:
        """The shapes and dtypes of `init(params, key)`, without running it."""
        return jax.eval_shape(self._programs.initial(params.replicas == 1), params, key)

    def memory(self) -> MemoryEstimate:
        """The memory `step` needs per device and per stage, predicted before
        compiling (pipejax/compile/memory.py); print it for a table."""
        return self._programs.memory()

    def opt_state(self, state: TrainState, replica: int = 0) -> list[Any]:
        """The K per-stage optax states of one replica as ordinary pytrees
        (stage k's over its list of layer variables; a sharded stage's
        joined from its devices' pieces)."""
        return opt_states(state.opt_state, self.build.code.params, self.build.F, replica)
