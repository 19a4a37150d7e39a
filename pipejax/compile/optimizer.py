"""Per-stage optimizers: one optax transformation per stage, on that stage's device.

The optimizer is an optax `GradientTransformation` (the same for every
stage) or a function `StageInfo -> GradientTransformation`, so that
staleness-aware transforms get their stage's delay and horizons from the
schedule table. Each stage's transform sees that stage's parameters only (a
tree-wide transform such as `optax.clip_by_global_norm` in the chain acts per
stage; `clip_norm` clips by the norm over all stages instead). Its state
is packed like the parameters (a `Staged`), and unpacks into ordinary optax
states. A stage whose chain ends in `pj.transforms.weight_forecast` runs
its forward (and backward, given a backward horizon) on the predicted
weights.

On a stage sharded over F devices (compile/fsdp.py) each device's
transform runs on its piece of every leaf (`Packing.shard`): exact for
element-wise transforms (SGD, momentum, Adam, AdamW, the forecasts, spike
compensation; a mask by a matrix's rank too), while a transform that
reduces over a leaf or the stage's tree (optax.clip_by_global_norm in the
chain, a trust ratio) reduces over the piece: clip with the trainer's
`clip_norm`. A transform whose state is not shaped like the leaves it
updates (Adafactor's factored moments) is refused: its state on a piece is
not a piece of its state.

This is the inner part of an update; the outer part (pipejax/compile/
outer.py: the data rule between replicas, the global-norm clip, the
non-finite guard) runs around it, outside the switch. Which of the two
update paths a program runs (the chain fused with its forecast in the
switch, or the outer pieces around it) is chosen once, by `updater`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax import checks
from pipejax.compile.build import Build
from pipejax.compile import pieces
from pipejax.compile.outer import Outer, all_finite
from pipejax.packing import Buffers, Packing
from pipejax.compile.sharing import StageGroups
from pipejax.compile.spmd import lead, local, params as rows, per_device, run_if, shard
from pipejax.compile.state import Staged
from pipejax.compile.ties import counted_once
from pipejax.transforms import forecast, forecasts_backward, has_forecast
from pipejax.transforms.per_stage import Optimizer, per_stage

Update = Callable[..., tuple]  # (p, grads, OptState, when) -> (p, OptState, skipped)


class OptState(NamedTuple):
    """Inside shard_map: one device's optimizer state."""

    stages: Buffers  # its stage's optax state, packed
    rule: Any  # the data rule's (before, after) states; () without a rule
    ahead: Buffers = ()  # the forward's forecast weights, packed like the params, kept
    # up to date by every update (`StageOptimizers.ahead`); () when no stage forecasts


@dataclasses.dataclass(frozen=True, eq=False)
class StageOptimizers:
    """The inner part of an update, the K transforms with the parameter
    packing they read and their state's packing, and its outer part."""

    transforms: tuple[optax.GradientTransformation, ...]
    params: Packing
    packing: Packing
    groups: StageGroups  # stages with one transform and one parameter structure share a branch
    outer: Outer

    @classmethod
    def of(cls, optimizer: Optimizer, build: Build, outer: Outer) -> "StageOptimizers":
        schedule, params = build.schedule, build.layout.pieces
        transforms = per_stage(optimizer, [schedule.stage_info(k) for k in range(build.K)],
                               "pipe.trainer")
        if build.F > 1:
            for k, t in enumerate(transforms):
                pieces.check(t.init, build.code.params, k, build.F)
        states = [jax.eval_shape(t.init, params.abstract_tree(k)) for k, t in enumerate(transforms)]
        checks.forecast(schedule, [has_forecast(s) for s in states])
        groups = StageGroups.by([(transforms[k], params.structure(k)) for k in range(build.K)],
                                lambda a, b: a[0] is b[0] and a[1] == b[1], build.code.share)
        axes = [pieces.tensor_axes(s, params, k) for k, s in enumerate(states)]
        return cls(transforms, params, Packing.of(states, tensor_axes=axes, tensor=params.tensor),
                   groups, outer)

    @functools.cached_property
    def forecasting(self) -> tuple[bool, ...]:
        """Which stages' chains end in `weight_forecast`."""
        return tuple(has_forecast(self.packing.abstract_tree(k)) for k in range(len(self.transforms)))

    def init_program(self, build: Build, replicated: bool) -> Callable[[Staged], tuple]:
        """Staged params (one model when `replicated`, else R replicas) ->
        (params, optimizer state, rule state) of R replicas, each on its
        device (with FSDP: each device's state of its piece, `per_device`)."""
        pp, sp = self.params, self.packing
        branches = self.groups.branches(
            lambda k: lambda p: sp.pack(k, self.transforms[k].init(pp.unpack(k, p))))

        def body(p):
            p = local(p)
            s = self.groups.switch(branches, p)
            return lead(p), lead(s), lead(self.outer.init(p))

        device = per_device(build.mesh)
        program = shard(body, build.mesh, (rows(build.mesh, replicas=not replicated),),
                        (rows(build.mesh), device, device))

        def run(params: Staged) -> tuple:
            p, s, rule = program(params.buffers)
            return Staged(p, build.code.params), Staged(s, sp), rule

        return run

    def stage_update(self, k: int, apply: bool = True) -> Callable:
        """Stage k's optax update of its packed (params, grads, state): the
        new params and state, and the forecast the next forward runs on
        (computed here, where XLA fuses it with the update: one more write of
        the weights instead of a pass at every forward); or (`apply=False`)
        the packed update and state."""
        pp, sp, ahead = self.params, self.packing, any(self.forecasting)

        def run(p, packed_grads, s):
            params, grads = pp.unpack(k, p), pp.unpack(k, packed_grads)
            updates, s = self.transforms[k].update(grads, sp.unpack(k, s), params)
            if not apply:
                return pp.pack(k, updates), sp.pack(k, s)
            new = optax.apply_updates(params, updates)
            if not ahead:
                return pp.pack(k, new), sp.pack(k, s), ()
            seen = forecast(new, s) if self.forecasting[k] else new
            return pp.pack(k, new), sp.pack(k, s), pp.pack(k, seen)
        return run

    def _branches(self, apply: bool) -> list[Callable]:
        """One `stage_update` per stage group."""
        return self.groups.branches(lambda k: self.stage_update(k, apply))

    def updater(self, scope: tuple[str, ...] = ()) -> Update:
        """The update a program runs, chosen once for it: `update(p, grads,
        s, when) -> (p, s, skipped)`, inside shard_map, this stage's update
        of its packed params; `when` (None: always) keeps params and state
        unchanged where false; `skipped` is 1 where the guard dropped a
        non-finite gradient, else 0, checked over mesh axes `scope` on the
        gradients the stage's chain would take (after the rule's `before`).

        Without outer collectives the chain runs in the stage switch with the
        forecast of the next forward (one fused update). With them the outer
        pieces run around the chain on every device at every call and mask
        the result: XLA CPU deadlocks on a collective only some devices reach.
        """
        update = self._around if self.outer.collective else self._fused
        return functools.partial(update, scope=scope)

    def _guard(self, grads: Buffers, when: jax.Array | None, scope: tuple[str, ...]) -> tuple:
        """(ok, when, skipped) of the non-finite guard: ok None without it."""
        if not self.outer.skip_nonfinite:
            return None, when, jnp.int32(0)
        ok = all_finite(grads, scope)
        skipped = ((True if when is None else when) & ~ok).astype(jnp.int32)
        return ok, ok if when is None else when & ok, skipped

    def _fused(self, p: Buffers, grads: Buffers, s: OptState, when: jax.Array | None = None, *,
               scope: tuple[str, ...]) -> tuple:
        """The chain and the forecast in the stage switch (no outer collectives)."""
        _, when, skipped = self._guard(grads, when, scope)
        branches = [lambda d, c, b=b: b(c[0], d, c[1]) for b in self._branches(apply=True)]
        apply = lambda d, c: self.groups.run(branches, d, c)
        p, stages, ahead = (apply(grads, (p, s.stages, s.ahead)) if when is None
                            else run_if(when, apply, grads, (p, s.stages, s.ahead)))
        return p, OptState(stages, (), ahead), skipped

    def _around(self, p: Buffers, grads: Buffers, s: OptState, when: jax.Array | None = None, *,
                scope: tuple[str, ...]) -> tuple:
        """The outer pieces around the chain: the rule's `before`, the guard
        (on the gradients the chain would take), the clip, the chain's
        updates, the rule's `after`; masked by `when` at the end."""
        outer = self.outer
        grads, rule = outer.before(grads, s.rule, p)
        ok, when, skipped = self._guard(grads, when, scope)
        grads = outer.clip(grads, ok, counted_once(self.params, grads))
        step = lambda ops, c: self.groups.switch(self._branches(apply=False), *ops, c[1])
        if when is None:
            updates, stages = step((p, grads), (None, s.stages))
        else:
            updates, stages = run_if(when, step, (p, grads), (self.params.zeros(), s.stages))
        updates, rule = outer.after(updates, rule, p)
        new = (optax.apply_updates(p, updates), rule)
        if when is not None:
            new = jax.tree.map(lambda n, o: jnp.where(when, n, o), new, (p, s.rule))
        state = OptState(stages, new[1])
        return new[0], state._replace(ahead=self.ahead(new[0], state)), skipped

    def ahead(self, p: Buffers, s: OptState) -> Buffers:
        """Inside shard_map: the forecast weights for `OptState.ahead` from
        (p, s), () when no stage forecasts: at the start of a pass, and after
        an update whose data rule or clip acts outside the stage switch."""
        branches = self._forecast_branches(backward=False)
        return () if branches is None else self.groups.switch(branches, p, s.stages)

    @functools.cached_property
    def forecasts_backward(self) -> bool:
        """Whether some stage's backward runs on a forecast of its own."""
        return self._forecast_branches(backward=True) is not None

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
