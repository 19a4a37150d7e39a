"""Per-stage optimizers: one optax transformation per stage, on that stage's device.

The optimizer is an optax `GradientTransformation` (the same for every
stage) or a function `StageInfo -> GradientTransformation`, so that
staleness-aware transforms get their stage's delay and horizons from the
schedule table. Each stage's transform sees that stage's parameters only (a
tree-wide transform such as `clip_by_global_norm` acts per stage). Its state
is packed like the parameters (a `Staged`), and unpacks into ordinary optax
states. A stage whose chain ends in `pj.transforms.weight_forecast` runs its
forward (and backward, given a backward horizon) on the predicted weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax
from jax import lax
from jax.sharding import Mesh

from pipejax.compile.packing import Packing
from pipejax.compile.spmd import STAGED, lead, local, shard, stage_index
from pipejax.compile.state import Staged
from pipejax.errors import ArgumentTypeError
from pipejax.schedules import Schedule
from pipejax.transforms import forecast, forecast_horizon, has_forecast

Optimizer = Any  # optax.GradientTransformation | Callable[[StageInfo], GradientTransformation]


@dataclasses.dataclass(frozen=True, eq=False)
class StageOptimizers:
    """The K transforms, the parameter packing they read, their state's packing,
    and which stages forecast their weights."""

    transforms: tuple[optax.GradientTransformation, ...]
    params: Packing
    packing: Packing
    forecasting: tuple[bool, ...]

    @classmethod
    def of(cls, optimizer: Optimizer, schedule: Schedule, params: Packing) -> "StageOptimizers":
        K = schedule.stages
        if isinstance(optimizer, optax.GradientTransformation):
            transforms = [optimizer] * K
        elif callable(optimizer):
            transforms = [optimizer(schedule.stage_info(k)) for k in range(K)]
            bad = [k for k, t in enumerate(transforms)
                   if not isinstance(t, optax.GradientTransformation)]
            if bad:
                raise ArgumentTypeError(
                    f"the optimizer function returned {type(transforms[bad[0]]).__name__} for stage "
                    f"{bad[0]}; it must return an optax GradientTransformation for every StageInfo")
        else:
            raise ArgumentTypeError(
                f"optimizer must be an optax GradientTransformation or a function StageInfo -> "
                f"GradientTransformation, not {type(optimizer).__name__}")
        states = [jax.eval_shape(transforms[k].init, params.abstract_tree(k)) for k in range(K)]
        return cls(tuple(transforms), params, Packing.of(states),
                   tuple(has_forecast(s) for s in states))

    def init_program(self, mesh: Mesh) -> Callable[[Staged], Staged]:
        """Staged params -> Staged optimizer state, each stage's on its device."""
        K, pp, sp = len(self.transforms), self.params, self.packing
        branches = [lambda p, k=k: sp.pack(k, self.transforms[k].init(pp.unpack(k, p)))
                    for k in range(K)]
        body = lambda p: lead(lax.switch(stage_index(), branches, local(p)))
        program = shard(body, mesh, (STAGED,), STAGED)
        return lambda params: Staged(program(params.buffers), sp)

    def update_branches(self) -> list[Callable]:
        """Branch k: stage k's optax update of its packed (params, grads, state)."""
        pp, sp = self.params, self.packing

        def branch(k):
            def run(p, g, s):
                params, grads = pp.unpack(k, p), pp.unpack(k, g)
                updates, s = self.transforms[k].update(grads, sp.unpack(k, s), params)
                return pp.pack(k, optax.apply_updates(params, updates)), sp.pack(k, s)
            return run

        return [branch(k) for k in range(len(self.transforms))]

    def forecast_branches(self, backward: bool) -> list[Callable] | None:
        """Branch k: (packed params, packed state) -> the weights stage k's
        forward (or backward) runs on: its forecast, or the params themselves
        when its chain has no `weight_forecast`. None when no stage forecasts.
        A backward horizon of 0 (linear weight prediction) skips the work."""
        if not any(self.forecasting):
            return None
        pp, sp = self.params, self.packing

        def branch(k):
            def run(p, s):
                state = sp.unpack(k, s)
                predict = lambda: pp.pack(k, forecast(pp.unpack(k, p), state, backward=backward))
                if not backward:
                    return predict()
                return lax.cond(forecast_horizon(state, True) != 0, predict, lambda: p)
            return run if self.forecasting[k] else (lambda p, s: p)

        return [branch(k) for k in range(len(self.transforms))]
