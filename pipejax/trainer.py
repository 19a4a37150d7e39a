"""`pipe.trainer(optimizer)`: an optimizer bound to a pipeline, in optax's style.

The pipeline is an immutable description; a trainer binds an optax
transformation (or a function `StageInfo -> transformation`) to it and
compiles its own programs, so two trainers of one pipeline are independent.
`init` makes the whole `TrainState`, for an asynchronous schedule its
in-flight part too; `step` and `flush` are jitted, placed so that the state
they return is the state they take, and so run one compiled program from the
first call on; `opt_state` unpacks each stage's optax state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipejax.compile import asynchronous, guarded, synchronous
from pipejax.compile.optimizer import Optimizer, StageOptimizers
from pipejax.compile.spmd import REPLICATED, STAGED, placement
from pipejax.compile.state import InFlight, Staged, TrainState
from pipejax.pipeline import Pipeline


class Trainer:
    """`init`, `step`, `flush` and `opt_state` for one optimizer on one pipeline.

    `step(state, (x, y)) -> (state, metrics)` and `flush(state) -> (state,
    metrics)` are jitted (`trainer.step.lower(state, batch).compile()` works).
    Metrics: "loss" (mean over the micro-batches the call finished; NaN if
    none), "completed" (how many), "losses" and "microbatch" (each finished
    micro-batch's loss and global id; NaN loss where one did not finish).
    """

    def __init__(self, pipe: Pipeline, optimizer: Optimizer):
        self.pipeline = pipe
        self.optimizers = StageOptimizers.of(optimizer, pipe.schedule, pipe.code.params)
        args = (pipe.code, pipe.schedule, pipe.layout, pipe.mesh, self.optimizers)
        if pipe.schedule.synchronous:
            step = synchronous.train_step(*args, pipe.example, pipe.targets)
            flush = synchronous.flush
        else:
            step = asynchronous.train_step(*args, pipe.example, pipe.targets)
            flush = asynchronous.flush(*args)
        out = (self.shardings, placement(pipe.mesh, REPLICATED))
        self.step = guarded(jax.jit(step, out_shardings=out), pipe.mesh)
        self.flush = guarded(jax.jit(flush, out_shardings=out), pipe.mesh)
        self._init_opt = guarded(jax.jit(self.optimizers.init_program(pipe.mesh)), pipe.mesh)

    @property
    def shardings(self) -> TrainState:
        """Where every part of the state lives (a pytree prefix of `TrainState`)."""
        staged, replicated = placement(self.pipeline.mesh, STAGED), placement(self.pipeline.mesh,
                                                                               REPLICATED)
        inflight = None
        if self.pipeline.schedule.asynchronous:
            inflight = InFlight(staged, staged, staged, replicated, replicated, replicated)
        return TrainState(staged, staged, replicated, replicated, inflight)

    def init(self, params: Staged, key: jax.Array | None = None) -> TrainState:
        """The state before the first step: `params` (from `pipe.init` or
        `pipe.stage`), each stage's optimizer state, step 0, `key` (needed when
        a layer draws random numbers) and, asynchronous, an empty pipeline."""
        pipe = self.pipeline
        pipe.check_params(params, "trainer.init")
        key = pipe.key_or_default(key, "trainer.init")
        inflight = None
        if pipe.schedule.asynchronous:
            inflight = asynchronous.init_inflight(pipe.layout, pipe.example, pipe.targets)
        state = TrainState(params, self._init_opt(params), jnp.zeros((), jnp.int32), key, inflight)
        return jax.device_put(state, self.shardings)

    def opt_state(self, state: TrainState) -> list[Any]:
        """The K per-stage optax states as ordinary pytrees (stage k's over
        its list of layer variables)."""
        return state.opt_state.per_stage()
