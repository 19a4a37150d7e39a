"""`pj.pipeline`: the public entry point that runs the data flow end to end.

layer list ─trace→ LayerSpec[] ─partition→ Plan ─schedule→ Table ─compile→ step
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax.compile import Executor, StagedParams, TrainState
from pipejax.compile.executor import SteppedOnce
from pipejax.errors import ConfigError, LayerError
from pipejax.mesh import stage_mesh
from pipejax.partition import Plan, make_plan
from pipejax.schedules import Schedule, make_schedule
from pipejax.trace import trace

REMATS = ("none", "stage")


def _check_remat(remat: Any) -> Any:
    if isinstance(remat, str):
        if remat not in REMATS:
            raise ConfigError(f"unknown remat {remat!r}; use 'none', 'stage' or a "
                              "jax.checkpoint policy such as jax.checkpoint_policies.dots_saveable")
    elif not callable(remat):
        raise ConfigError(f"remat must be 'none', 'stage' or a jax.checkpoint policy, not {remat!r}")
    return remat


class Pipeline:
    """A layer list compiled for a stage mesh. Build it with `pj.pipeline`."""

    def __init__(self, layers: Sequence[Any], *, loss: Callable, example: Any, stages: int,
                 microbatches: int, schedule: str | Schedule = "gpipe",
                 partition: str | Sequence[int] = "variance", remat: Any = "stage",
                 mesh: Mesh | None = None, cost: str = "flops", max_bytes: float | None = None,
                 weight_stashing: bool = False):
        if not isinstance(layers, (list, tuple)):
            raise LayerError(f"layers must be a list of Flax modules or functions, not "
                             f"{type(layers).__name__}; a model is a list so it can be split")
        if len(layers) == 0:
            raise LayerError("the layer list is empty; give at least one layer")
        if not isinstance(stages, (int, np.integer)) or stages < 1:
            raise ConfigError(f"stages={stages!r}; a pipeline needs at least 1 stage")
        if stages > len(layers):
            raise ConfigError(f"stages={stages} > {len(layers)} layers; every stage needs a layer, "
                              "use fewer stages or split the model into more layers")
        if not isinstance(microbatches, (int, np.integer)) or microbatches < 1:
            raise ConfigError(f"microbatches={microbatches!r}; use at least 1")
        self.layers = list(layers)
        self.loss = loss
        self.example = example
        self.remat = _check_remat(remat)
        self.schedule: Schedule = make_schedule(schedule, stages, microbatches)
        if weight_stashing and self.schedule.synchronous:
            raise ConfigError(f"weight_stashing=True needs an asynchronous schedule; under "
                              f"{self.schedule.name!r} every backward already uses its forward's weights")
        if self.schedule.asynchronous and not weight_stashing and self.remat != "stage":
            raise ConfigError(
                f"remat={self.remat!r} keeps residuals computed with the forward's weights, but "
                f"the backward of {self.schedule.name!r} uses the current weights (the exact vjp "
                "at (backward weights, stashed input)); use remat='stage' or weight_stashing=True")
        self.mesh = stage_mesh(stages, mesh)
        self.specs = trace(self.layers, example, cost=cost)
        self.plan: Plan = make_plan(self.specs, stages, partition, max_bytes)
        self.K, self.M = stages, microbatches
        self.executor = Executor(self.layers, self.plan, self.schedule, loss, self.remat, self.mesh,
                                 example, weight_stashing)
        self._value_and_grad = SteppedOnce(jax.jit(self.executor.value_and_grad), self.mesh)
        self._step = None

    # ----------------------------------------------------------- public API
    def init(self, key: jax.Array) -> StagedParams:
        """Parameters, each stage's on its own device (layer i from fold_in(key, i))."""
        return self.executor.init_params(key)

    def stage(self, variables: Sequence[dict]) -> StagedParams:
        """Stage one variables dict per layer (the inverse of `pj.unstage`)."""
        if len(variables) != len(self.layers):
            raise ConfigError(f"got {len(variables)} variables dicts for {len(self.layers)} layers")
        return self.executor.stage(variables)

    def value_and_grad(self, params: StagedParams, batch: tuple,
                       key: jax.Array | None = None) -> tuple[jax.Array, StagedParams]:
        """Mean loss over the micro-batches and its gradient (synchronous schedules)."""
        key = jax.random.key(0) if key is None else key
        return self._value_and_grad(params, batch, key)

    def init_state(self, params: StagedParams, optimizer: Any,
                   key: jax.Array | None = None) -> TrainState:
        """Train state for `optimizer` (an optax transform, or StageInfo -> transform);
        also builds `pipe.step` for it."""
        ex = self.executor
        self._opts = ex.optimizers(optimizer)
        self._opt_pack = ex.opt_packing(self._opts)
        self._step = ex.make_step(self._opts, self._opt_pack)
        self._flush = ex.make_flush(self._opts, self._opt_pack)
        key = jax.random.key(0) if key is None else key
        return ex.init_state(params, self._opts, self._opt_pack, key)

    def flush(self, state: TrainState) -> tuple[TrainState, dict]:
        """Drain an asynchronous pipeline: finish every micro-batch in flight
        (their updates included). A no-op for synchronous schedules."""
        if self._step is None:
            raise ConfigError("call pipe.init_state(params, optimizer) first")
        return self._flush(state)

    @property
    def weight_stash_bytes(self) -> int:
        """Extra memory per stage for weight stashing: one weight version per
        micro-batch in flight between its forward and backward (0 if off)."""
        if not self.executor.weight_stashing:
            return 0
        return self.schedule.residual_capacity * self.plan.param_packing.slot_bytes()

    @property
    def step(self) -> Callable:
        """The jitted `step(state, (x, y)) -> (state, metrics)`."""
        if self._step is None:
            raise ConfigError("pipe.step is built by pipe.init_state(params, optimizer); call it first")
        return self._step
