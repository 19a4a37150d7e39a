"""Weight forecasts: predict the weights a stage will hold when a micro-batch's
gradient arrives, from the optimizer's own velocity (SpecTrain, Chen et al.
2018, §3.2, eq. 4; linear weight prediction, Kosson et al. 2020, §3.4).

`weight_forecast` is the LAST transform of a chain: it passes the final
update through unchanged and keeps what a forecast needs. `forecast(params,
opt_state)` then returns the predicted weights; the pipelined executor runs a
stage's forward on them (and, with a backward horizon, its backward on a
second prediction). `has_forecast`, `forecasts_backward` and `forecast` are
all the executor asks of an optimizer state (docs/design.md, the contract
between compile/ and transforms/).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax.errors import ConfigError

FORMS = ("difference", "velocity")


class DirectionState(NamedTuple):
    """The update direction d of the last update, as the chain computed it
    up to `update_direction` (Adam's m̂/(√v̂ + ε))."""

    direction: optax.Updates


def update_direction() -> optax.GradientTransformation:
    """Keep the updates that reach it, the optimizer's direction d, for the
    velocity form of `weight_forecast` (ŵ = w − η·T·d): PipeOptim's
    prediction Ŵ_{t+s} = W_t − lr·s·ΔW_t with ΔW_t the optimizer's own
    direction (Guan et al. 2023, arXiv 2312.00839, and its table of ΔW_t).
    Place it after the scaling (`optax.scale_by_adam`) and before the weight
    decay and the rate, as `AdamW(...)(rate, direction=True)` does; updates
    pass through unchanged. On SGDM the direction is the momentum trace v,
    which the velocity form reads without it."""

    def init_fn(params):
        return DirectionState(optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del state, params
        return updates, DirectionState(updates)

    return optax.GradientTransformation(init_fn, update_fn)


class WeightForecastState(NamedTuple):
    """Holds the horizons T and what the form needs: the last applied update
    w_t − w_{t−1} (difference form), or η of the last update and the update
    count (velocity form). `backward_horizon` is None when it is 0, so a
    pipeline knows without running anything that a stage's backward needs
    no forecast."""

    horizon: jax.Array  # float32: T of the forward
    backward_horizon: jax.Array | None  # float32: T of the backward; None for 0
    last_update: optax.Updates | None  # difference form
    learning_rate: jax.Array | None  # velocity form: η of the update the forecast extrapolates
    count: jax.Array | None  # velocity form: int32, updates seen (the schedule's step)


def _number(x: Any) -> Any:
    """A horizon as a float, or as it is when an array (optax.inject_hyperparams)."""
    return float(x) if isinstance(x, (int, float, np.integer, np.floating)) else x


def _horizons(horizon: Any, stage: Any) -> tuple[Any, Any]:
    if isinstance(horizon, str):
        if horizon != "spectrain":
            raise ConfigError(f"weight_forecast: unknown horizon {horizon!r}; give a number T, "
                              "a pair (T_forward, T_backward) or 'spectrain'")
        if stage is None:
            raise ConfigError("weight_forecast(horizon='spectrain') takes its horizons from the "
                              "schedule: pass stage=s, the StageInfo the optimizer function receives")
        return float(stage.forward_horizon), float(stage.backward_horizon)
    if isinstance(horizon, Sequence):
        if len(horizon) != 2:
            raise ConfigError(f"weight_forecast: horizon {horizon!r} must be (T_forward, T_backward)")
        return _number(horizon[0]), _number(horizon[1])
    return _number(horizon), 0.0


def weight_forecast(horizon: float | tuple[float, float] | str, *, form: str = "difference",
                    learning_rate: optax.ScalarOrSchedule | None = None,
                    stage: Any = None) -> optax.GradientTransformation:
    """Keep what `forecast` needs to predict the weights T updates ahead:

        difference form   ŵ = w + T·(w_t − w_{t−1})     (Kosson et al. 2020, §3.4)
        velocity form     ŵ = w − η·T·v                  (Kosson et al. 2020, §3.4;
                                                          Chen et al. 2018, eq. 4;
                                                          Guan et al. 2023)

    The difference form works after any optimizer (Adam included); the
    velocity form reads the momentum trace v (the `trace` field of an
    `optax.trace` or `spike_compensation` state in the same chain) and is
    Kosson et al.'s default (appendix H.5), or the direction an
    `update_direction` in the chain kept (PipeOptim: Adam's m̂/(√v̂ + ε)).
    The two are equal for plain SGDM and differ under spike compensation.
    Updates pass through unchanged: this must be the chain's last transform.

    Args:
      horizon: T for the forward (the backward then uses the current
        weights), a pair (T_forward, T_backward), or "spectrain": the
        stage's SpecTrain horizons (eqs 5–6) from `stage`.
      form: "difference" or "velocity".
      learning_rate: η, for the velocity form: the rate (a float or an optax
        schedule of the update count) of the chain's
        `optax.scale_by_learning_rate`. The forecast uses η of the update it
        extrapolates, the last one applied, so that both forms stay equal for
        SGDM under a decaying schedule.
      stage: the `StageInfo` of a pipeline stage, for horizon="spectrain".

    Horizons and the rate may be arrays (`optax.inject_hyperparams`); a
    backward horizon given as an array is kept even when it is 0.
    """
    if form not in FORMS:
        raise ConfigError(f"weight_forecast: form={form!r}; use 'difference' or 'velocity'")
    if form == "velocity" and learning_rate is None:
        raise ConfigError("weight_forecast(form='velocity') predicts w − η·T·v: pass "
                          "learning_rate=η (a float or an optax schedule), the rate of the "
                          "chain's optax.scale_by_learning_rate(η)")
    forward, backward = _horizons(horizon, stage)
    rate = None if form == "difference" else (
        learning_rate if callable(learning_rate) else (lambda _: learning_rate))

    def init_fn(params):
        last = optax.tree.zeros_like(params) if form == "difference" else None
        count = None if rate is None else jnp.zeros((), jnp.int32)
        eta = None if rate is None else jnp.asarray(rate(count), jnp.float32)
        # a backward horizon of a Python 0 is none at all (structure, not value)
        none = isinstance(backward, float) and backward == 0.0
        return WeightForecastState(jnp.asarray(forward, jnp.float32),
                                   None if none else jnp.asarray(backward, jnp.float32),
                                   last, eta, count)

    def update_fn(updates, state, params=None):
        del params
        if rate is None:
            return updates, state._replace(last_update=updates)
        eta = jnp.asarray(rate(state.count), jnp.float32)
        return updates, state._replace(learning_rate=eta,
                                       count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def _forecast_states(opt_state: Any) -> list[WeightForecastState]:
    is_state = lambda x: isinstance(x, WeightForecastState)
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]


def has_forecast(opt_state: Any) -> bool:
    """Whether `opt_state` (a whole chain's state) holds a `weight_forecast`."""
    return bool(_forecast_states(opt_state))


def _the_state(opt_state: Any) -> WeightForecastState:
    found = _forecast_states(opt_state)
    if len(found) != 1:
        raise ConfigError(f"forecast: the optimizer state holds {len(found)} weight_forecast "
                          "states; end the chain with exactly one pj.transforms.weight_forecast")
    return found[0]


def forecast_horizon(opt_state: Any, backward: bool = False) -> jax.Array:
    """The forward (or backward) horizon T a chain's `weight_forecast` holds."""
    state = _the_state(opt_state)
    if not backward:
        return state.horizon
    return jnp.float32(0) if state.backward_horizon is None else state.backward_horizon


def forecasts_backward(opt_state: Any) -> bool:
    """Whether a chain's state forecasts the weights of the backward too
    (a nonzero backward horizon, as SpecTrain's); known from its structure."""
    return has_forecast(opt_state) and _the_state(opt_state).backward_horizon is not None


def forecast(params: optax.Params, opt_state: Any, horizon: Any = None, *,
             backward: bool = False) -> optax.Params:
    """The predicted weights ŵ (see `weight_forecast`) from a chain's state.

    Args:
      params: the current weights w.
      opt_state: the state of the chain that ends in `weight_forecast`.
      horizon: T; default the state's forward horizon (backward=False) or
        backward horizon (backward=True).
    """
    state = _the_state(opt_state)
    T = forecast_horizon(opt_state, backward) if horizon is None else horizon
    if state.last_update is not None:
        return jax.tree.map(lambda w, d: w + T * d.astype(w.dtype), params, state.last_update)
    velocities = (optax.tree.get_all_with_path(opt_state, "trace")
                  + optax.tree.get_all_with_path(opt_state, "direction"))
    if len(velocities) != 1:
        raise ConfigError(f"forecast(form='velocity') needs one velocity in the chain (the "
                          f"trace of optax.trace or spike_compensation, or an update_direction) "
                          f"and found {len(velocities)}; use form='difference', which works after "
                          "any optimizer")
    v = velocities[0][1]
    return jax.tree.map(lambda w, u: w - state.learning_rate * T * u.astype(w.dtype), params, v)
