"""Per-stage optimizers: one optax transformation per stage, on that stage's device.

The optimizer is an optax `GradientTransformation` (the same for every
stage) or a function `StageInfo -> GradientTransformation`, so that
staleness-aware transforms get their stage's delay and horizons from the
schedule table. Each stage's transform sees that stage's parameters only (a
tree-wide transform such as `optax.clip_by_global_norm` in the chain acts per
stage; `clip_norm` clips by the norm over all stages instead). Its state
is packed like the parameters (a `Staged`), and unpacks into ordinary optax
states. A stage whose chain ends in `pj.transforms.weight_forecast` runs its
forward (and backward, given a backward horizon) on the predicted weights.

On a mesh with data axes every replica runs its own copy, and a `DataRule`
(pipejax/transforms/data_parallel.py) combines them: its `before` half on
the packed gradients, then the stage's optimizer in the per-stage switch,
then its `after` half on the packed update. Both halves run outside the
switch (DESIGN.md: collectives never sit in a branch); the rules are
element-wise, so on packed buffers they equal the rules on the stage trees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh

from pipejax.compile.packing import Buffers, Packing
from pipejax.compile.sharing import StageGroups
from pipejax.compile.spmd import STAGED, lead, local, per_replica, run_if, shard
from pipejax.compile.state import Staged
from pipejax.errors import ArgumentTypeError, ConfigError
from pipejax.mesh import AXIS
from pipejax.schedules import Schedule
from pipejax.transforms import forecast, forecasts_backward, has_forecast
from pipejax.transforms.data_parallel import DataRule, consensus_distance

Optimizer = Any  # optax.GradientTransformation | Callable[[StageInfo], GradientTransformation]


class OptState(NamedTuple):
    """Inside shard_map: one device's optimizer state."""

    stages: Buffers  # its stage's optax state, packed
    rule: Any  # the data rule's (before, after) states; () without a rule
    ahead: Buffers = ()  # the forward's forecast weights, packed like the params, kept
    # up to date by every update (`StageOptimizers.ahead`); () when no stage forecasts


@dataclasses.dataclass(frozen=True, eq=False)
class StageOptimizers:
    """The K transforms, the parameter packing they read, their state's packing,
    which stages forecast their weights, and the rule between R replicas."""

    transforms: tuple[optax.GradientTransformation, ...]
    params: Packing
    packing: Packing
    forecasting: tuple[bool, ...]
    groups: StageGroups  # stages with one transform and one parameter structure share a branch
    rule: DataRule | None = None
    replicas: int = 1
    clip_norm: float | None = None  # clip by the global norm over all stages
    skip_nonfinite: bool = False  # skip (and count) updates with non-finite gradients

    @classmethod
    def of(cls, optimizer: Optimizer, schedule: Schedule, params: Packing,
           rule: DataRule | None = None, replicas: int = 1, clip_norm: float | None = None,
           skip_nonfinite: bool = False) -> "StageOptimizers":
        K = schedule.stages
        if clip_norm is not None and not clip_norm > 0:
            raise ConfigError(f"clip_norm={clip_norm}; the largest global gradient norm must be "
                              "a positive number (or None for no clipping)")
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
        forecasting = tuple(has_forecast(s) for s in states)
        if schedule.synchronous and any(forecasting):
            raise ConfigError(
                f"stage {forecasting.index(True)}'s optimizer ends in weight_forecast, but "
                f"schedule {schedule.name!r} is synchronous: every backward sees the weights its "
                "forward used, so there is nothing to forecast; use an asynchronous schedule "
                "('pb', 'pipedream') or drop the forecast")
        groups = StageGroups.by([(transforms[k], params.structure(k)) for k in range(K)],
                                lambda a, b: a[0] is b[0] and a[1] == b[1])
        return cls(tuple(transforms), params, Packing.of(states), forecasting, groups, rule,
                   replicas, clip_norm, skip_nonfinite)

    def init_program(self, mesh: Mesh, replicated: bool) -> Callable[[Staged], tuple]:
        """Staged params (one model when `replicated`, else R replicas) ->
        (params, optimizer state, rule state) of R replicas, each on its device."""
        pp, sp, R = self.params, self.packing, self.replicas
        branches = self.groups.branches(
            lambda k: lambda p: sp.pack(k, self.transforms[k].init(pp.unpack(k, p))))

        def body(p):
            p = local(p)
            s = self.groups.switch(branches, p)
            rule = () if self.rule is None else (self.rule.before.init(p), self.rule.after.init(p))
            return lead(p), lead(s), lead(rule)

        spec = per_replica(mesh)
        program = shard(body, mesh, (STAGED if replicated else spec,), (spec, spec, spec))

        def run(params: Staged) -> tuple:
            p, s, rule = program(params.buffers)
            return Staged(p, pp, R), Staged(s, sp, R), rule

        return run

    def _branches(self, apply: bool) -> list[Callable]:
        """The branch of stage k's group: stage k's optax update of its packed (params, grads,
        state): the new params and state, and the forecast the next forward runs on
        (computed here, where XLA fuses it with the update: one more write of
        the weights instead of a pass at every forward); or (`apply=False`)
        the packed update and state."""
        pp, sp, ahead = self.params, self.packing, any(self.forecasting)

        def branch(k):
            def run(p, g, s):
                params, grads = pp.unpack(k, p), pp.unpack(k, g)
                updates, s = self.transforms[k].update(grads, sp.unpack(k, s), params)
                if not apply:
                    return pp.pack(k, updates), sp.pack(k, s)
                new = optax.apply_updates(params, updates)
                if not ahead:
                    return pp.pack(k, new), sp.pack(k, s), ()
                seen = forecast(new, s) if self.forecasting[k] else new
                return pp.pack(k, new), sp.pack(k, s), pp.pack(k, seen)
            return run

        return self.groups.branches(branch)

    @property
    def collective(self) -> bool:
        """Whether an update runs collectives (a data rule, the global norm)."""
        return self.rule is not None or self.clip_norm is not None

    def update(self, p: Buffers, grads: Buffers, s: OptState, when: jax.Array | None = None,
               scope: tuple[str, ...] = ()) -> tuple[Buffers, OptState, jax.Array]:
        """Inside shard_map: this stage's update of its packed params, with the
        data rule and the global-norm clip around it; returns (params, state,
        skipped: 1 if the guard dropped a non-finite gradient, else 0).

        `when` keeps params and state unchanged where it is false. A
        collective update runs its collectives on every device at every call
        and masks the result (XLA CPU deadlocks on a collective that only
        some devices reach). The guard checks the gradients the stage's
        optimizer would take (after the rule's average), over mesh axes `scope`.
        """
        if self.rule is not None:
            before, after = s.rule
            grads, before = self.rule.before.update(grads, before, p)
        skipped, ok = jnp.int32(0), None
        if self.skip_nonfinite:
            bad = sum(jnp.sum(~jnp.isfinite(g)) for g in grads).astype(jnp.int32)
            ok = (lax.psum(bad, scope) if scope else bad) == 0
            skipped = ((True if when is None else when) & ~ok).astype(jnp.int32)
            when = ok if when is None else when & ok
        if self.clip_norm is not None:
            grads = self._clip(grads, ok)
        if not self.collective:
            apply = lambda g, c: self.groups.switch(self._branches(apply=True), c[0], g, c[1])
            p, stages, ahead = (apply(grads, (p, s.stages, s.ahead)) if when is None
                                else run_if(when, apply, grads, (p, s.stages, s.ahead)))
            return p, OptState(stages, (), ahead), skipped
        step = lambda ops, c: self.groups.switch(self._branches(apply=False), *ops, c[1])
        if when is None:
            updates, stages = step((p, grads), (None, s.stages))
        else:
            updates, stages = run_if(when, step, (p, grads), (self.params.zeros(), s.stages))
        rule = ()
        if self.rule is not None:
            updates, after = self.rule.after.update(updates, after, p)
            rule = (before, after)
        new = (optax.apply_updates(p, updates), rule)
        if when is not None:
            new = jax.tree.map(lambda n, o: jnp.where(when, n, o), new, (p, s.rule))
        state = OptState(stages, new[1])
        return new[0], state._replace(ahead=self.ahead(new[0], state)), skipped

    def _clip(self, grads: Buffers, ok: jax.Array | None) -> Buffers:
        """`optax.clip_by_global_norm` over the gradients of ALL stages: the
        squared norm is summed over the stage axis (padding holds zeros), so
        the clip means what it means for the unpipelined model. A stage whose
        gradient the guard drops (`ok` false) adds nothing to the norm."""
        square = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads)
        if ok is not None:
            square = jnp.where(ok, square, 0.0)
        norm = jnp.sqrt(lax.psum(square, AXIS))
        trigger = norm < self.clip_norm
        return tuple(lax.select(trigger, g, (g / norm.astype(g.dtype)) * self.clip_norm)
                     for g in grads)

    def consensus(self, p: Buffers) -> jax.Array | None:
        """Inside shard_map: the spread of the replicas' weights (all stages),
        when the rule lets them differ; else None."""
        if self.rule is None or not self.rule.decentralized:
            return None
        return consensus_distance(p, self.rule.axes, over=(AXIS,))

    def ahead(self, p: Buffers, s: OptState) -> Buffers:
        """Inside shard_map: the forecast weights for `OptState.ahead` from
        (p, s), () when no stage forecasts: at the start of a pass, and after
        an update whose data rule or clip acts outside the stage switch."""
        branches = self._forecast_branches(backward=False)
        return () if branches is None else self.groups.switch(branches, p, s.stages)

    def backward_weights(self, p: Buffers, s: OptState) -> Buffers:
        """Inside shard_map: the weights this stage's backward runs on: a
        forecast made now for a backward horizon (SpecTrain), else `p`. (The
        forward's forecast is `s.ahead`, left there by the last update.)"""
        branches = self._forecast_branches(backward=True)
        return p if branches is None else self.groups.switch(branches, p, s.stages)

    def _forecast_branches(self, backward: bool) -> list[Callable] | None:
        """The branch of stage k's group: (packed params, packed state) -> stage k's forecast, or
        the params themselves when its chain makes none. None when no stage
        forecasts (for the backward: none has a nonzero backward horizon,
        known from the states' structure, so linear weight prediction's
        backward runs on the weights with no extra work)."""
        pp, sp = self.params, self.packing
        active = [f and (not backward or forecasts_backward(sp.abstract_tree(k)))
                  for k, f in enumerate(self.forecasting)]
        if not any(active):
            return None

        def branch(k):
            def run(p, s):
                return pp.pack(k, forecast(pp.unpack(k, p), sp.unpack(k, s), backward=backward))
            return run if active[k] else (lambda p, s: p)

        return self.groups.branches(branch)
