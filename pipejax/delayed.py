"""Delayed-gradient training on one device: the staleness of an asynchronous
pipeline without the pipeline (Kosson et al. 2020, appendix G.2).

Micro-batch i runs forward through the stages in order; on stage k it sees
the weights after i − D_k updates (their forecast, when the stage's chain
ends in `weight_forecast`), and its backward there uses the current weights
(inconsistent, their backward forecast if any) or the forward's weights
(consistent: weight stashing); then stage k applies the gradient at once.
A ring of D_k + 1 forward weights per stage holds the past. This is exactly
what the `pb` and `pipedream` executors compute, one micro-batch at a time,
and, an update a step's batch, delay 1 and consistent, what `2bw` computes;
so sweeps over delays, mitigations and seeds run fast on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from pipejax import checks
from pipejax.errors import ConfigError
from pipejax.layers import Layer, apply_layers, initial_variables, layer_list
from pipejax.placement import Placement
from pipejax.partition.balance import check_split
from pipejax.schedules import Schedule, StageInfo, make_schedule
from pipejax.transforms import forecast, has_forecast
from pipejax.transforms.per_stage import per_stage


class SimState(NamedTuple):
    """Per stage: weights, optax state and the ring of past forward weights."""

    weights: tuple  # per stage, a list of layer variables
    opt_states: tuple
    rings: tuple  # per stage, the weights trees stacked [D_k + 1, ...]
    step: jax.Array  # int32: micro-batches done (= updates of every stage)
    key: jax.Array


def _table(delays: Any, K: int) -> Schedule | None:
    """The table `delays` names (built with the fewest micro-batches a step
    every family runs at K; the delays do not depend on them), or None."""
    if not isinstance(delays, (str, Schedule)):
        return None
    table = make_schedule(delays, Placement(K), max(2, K - 1)) if isinstance(delays, str) \
        else delays
    if table.stages != K:
        raise ConfigError(f"schedule {table.name!r} has {table.stages} stages, the split {K}")
    return table


def _stage_infos(delays: Any, K: int, table: Schedule | None) -> list[StageInfo]:
    """Per stage, its delay and horizons: `table`'s (`_table(delays, K)`),
    or those of the numbers `delays`."""
    if table is not None:
        return [table.stage_info(k) for k in range(K)]
    ds = [int(delays)] * K if np.ndim(delays) == 0 else [int(d) for d in delays]
    if len(ds) != K or min(ds) < 0:
        raise ConfigError(f"delays {list(ds)} must be {K} numbers >= 0, one per stage")
    return [StageInfo(k, K, d, d, 0) for k, d in enumerate(ds)]


def _split(split: int | Sequence[int], L: int) -> tuple[int, ...]:
    """Layer counts per stage: as given (checked), or K counts as equal as possible."""
    if np.ndim(split) != 0:
        return check_split(split, L, len(split))
    K = int(split)
    if not 1 <= K <= L:
        raise ConfigError(f"split={K} stages for {L} layers; use 1 to {L}")
    return tuple(L // K + (k < L % K) for k in range(K))


@dataclasses.dataclass(frozen=True, eq=False)
class Simulation:
    """`init(variables, key)`, then `run(state, xs, ys) -> (state, losses)`."""

    layers: tuple[Layer, ...]
    loss: Callable
    ranges: tuple[range, ...]
    infos: tuple[StageInfo, ...]
    transforms: tuple[optax.GradientTransformation, ...]
    consistent: bool
    table: Schedule | None  # the family's table the delays come from, if one

    def __post_init__(self):
        # run(state, xs, ys) -> (state, losses): `_run`, jitted once per simulation;
        # the programs that build a state, once too.
        object.__setattr__(self, "run", jax.jit(self._run))
        object.__setattr__(self, "_start", jax.jit(self._state))

    @property
    def delays(self) -> list[int]:
        return [i.delay for i in self.infos]

    def _stage(self, k: int, key: jax.Array, y: Any) -> Callable:
        r, K = self.ranges[k], len(self.ranges)

        def f(w, h):
            out = apply_layers(self.layers[r.start:r.stop], w, h, key, first=r.start)
            return self.loss(out, y) if k == K - 1 else out
        return f

    @staticmethod
    def _predict(w: Any, s: Any, backward: bool) -> Any:
        return forecast(w, s, backward=backward) if has_forecast(s) else w

    def variables(self, key: jax.Array, example: Any) -> list[dict]:
        """Initial variables of every layer for inputs shaped like `example`
        (one micro-batch): layer i is initialized with fold_in(key, i), the
        values `pj.unstage(pipe.init(key))` gives for the same layers."""
        return initial_variables(self.layers, example, key)

    def init(self, variables: Sequence[dict], key: jax.Array | None = None) -> SimState:
        """The state before micro-batch 0: one variables dict per layer (as
        `pj.unstage` or `variables` return them), `key` for layers that draw
        random numbers."""
        if len(variables) != len(self.layers):
            raise ConfigError(f"got {len(variables)} variables dicts for {len(self.layers)} layers")
        return self._start(list(variables), jax.random.key(0) if key is None else key)

    def _state(self, variables: list[dict], key: jax.Array) -> SimState:
        w = tuple([variables[i] for i in r] for r in self.ranges)
        s = tuple(t.init(wk) for t, wk in zip(self.transforms, w))
        if self.table is not None:
            checks.forecast(self.table, [has_forecast(sk) for sk in s])
        rings = tuple(jax.tree.map(lambda a, D=i.delay: jnp.stack([a] * (D + 1)),
                                   self._predict(w[k], s[k], False))
                      for k, i in enumerate(self.infos))
        return SimState(w, s, rings, jnp.zeros((), jnp.int32), key)

    def _one(self, state: SimState, xy: tuple) -> tuple[SimState, jax.Array]:
        """Micro-batch i = state.step: forward with delayed weights, backward,
        and each stage's update."""
        x, y = xy
        i, K = state.step, len(self.ranges)
        key = jax.random.fold_in(state.key, i)
        slot = lambda k, v: jnp.maximum(v, 0) % (self.infos[k].delay + 1)
        fwd_w = [jax.tree.map(lambda r: r[slot(k, i - self.infos[k].delay)], state.rings[k])
                 for k in range(K)]
        h, inputs = x, []
        for k in range(K):
            inputs.append(h)
            h = self._stage(k, key, y)(fwd_w[k], h)
        loss, ct = h, None
        weights, opt_states, rings = [], [], []
        for k in reversed(range(K)):
            w, s = state.weights[k], state.opt_states[k]
            w_b = fwd_w[k] if self.consistent else self._predict(w, s, True)
            out, vjp = jax.vjp(self._stage(k, key, y), w_b, inputs[k])
            grads, ct = vjp(jnp.ones_like(out) if ct is None else ct)
            updates, s = self.transforms[k].update(grads, s, w)
            w = optax.apply_updates(w, updates)
            ahead = self._predict(w, s, False)
            rings.append(jax.tree.map(lambda r, a: r.at[slot(k, i + 1)].set(a), state.rings[k], ahead))
            weights.append(w), opt_states.append(s)
        new = SimState(tuple(weights[::-1]), tuple(opt_states[::-1]), tuple(rings[::-1]), i + 1,
                       state.key)
        return new, loss

    def _run(self, state: SimState, xs: Any, ys: Any) -> tuple[SimState, jax.Array]:
        """Micro-batches xs[j], ys[j] in order, one update each; returns the
        state and each micro-batch's loss (at its forward on the last stage)."""
        return lax.scan(self._one, state, (xs, ys))

    def params(self, state: SimState) -> list[dict]:
        """One variables dict per layer, as `pj.unstage` returns them."""
        return [w for stage in state.weights for w in stage]


def simulate(layers: Sequence[Layer], *, loss: Callable, optimizer: Any,
             split: int | Sequence[int], delays: Any = "pb",
             consistent: bool = False) -> Simulation:
    """Single-device training with each stage's gradient delayed as in a pipeline.

    Args:
      layers: the model, a list of Flax modules (linen or NNX) or functions, as
        for `pj.pipeline`.
      loss: `loss(outputs, targets)` of one micro-batch.
      optimizer: an optax transform, or a function `StageInfo -> transform`
        (e.g. `pj.transforms.mitigation(...).optimizer`).
      split: layer counts per stage (`pipe.plan.split`), or a number of
        stages K for counts as equal as possible.
      delays: a family's name ("pb", "pipedream", `pj.schedules.FAMILIES`) or a
        `Schedule` (per-stage delays and SpecTrain horizons from its table) |
        one delay D for every stage | D_k per stage.
      consistent: the backward uses the forward's weights (weight stashing);
        always under a double-buffered table (PipeDream-2BW: a step's ops
        run on one version), whose updates are a step's each: give each
        step's batch as one micro-batch.

    Returns:
      A `Simulation`: `state = sim.init(variables, key)`, `state, losses =
      sim.run(state, xs, ys)` with micro-batches stacked `[n, mb, ...]`
      (n updates), `sim.params(state)`.
    """
    layers = layer_list(layers)
    counts = _split(split, len(layers))
    starts = np.cumsum([0, *counts])
    ranges = tuple(range(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))
    table = _table(delays, len(counts))
    infos = tuple(_stage_infos(delays, len(counts), table))
    consistent = consistent or (table is not None and table.double_buffered)
    return Simulation(layers, loss, ranges, infos, per_stage(optimizer, infos), consistent,
                      table)
