"""Weight forecasts: predict the weights a stage will hold when a micro-batch's
gradient arrives, from the optimizer's own velocity (SpecTrain, Chen et al.
2018, §3.2, eq. 4; linear weight prediction, Kosson et al. 2020, §3.4).

`weight_forecast` is the LAST transform of a chain: it passes the final
update through unchanged and keeps what a forecast needs. `forecast(params,
opt_state)` then returns the predicted weights; the pipelined executor runs a
stage's forward on them (and, with a backward horizon, its backward on a
second prediction).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from pipejax.errors import ConfigError

FORMS = ("difference", "velocity")


class WeightForecastState(NamedTuple):
    """Holds the horizons T (forward, backward) and what the form needs: the
    last applied update w_t − w_{t−1} (difference form) or η (velocity form)."""

    horizons: jax.Array  # [2] float32
    last_update: optax.Updates | None
    learning_rate: jax.Array | None


def _horizons(horizon: Any, stage: Any) -> tuple[float, float]:
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
        return float(horizon[0]), float(horizon[1])
    return float(horizon), 0.0


def weight_forecast(horizon: float | tuple[float, float] | str, *, form: str = "difference",
                    learning_rate: float | None = None,
                    stage: Any = None) -> optax.GradientTransformation:
    """Keep what `forecast` needs to predict the weights T updates ahead:

        difference form   ŵ = w + T·(w_t − w_{t−1})     (Kosson et al. 2020, §3.4)
        velocity form     ŵ = w − η·T·v                  (Chen et al. 2018, eq. 4)

    The difference form works after any optimizer (Adam included); the
    velocity form reads the momentum trace v (the `trace` field of an
    `optax.trace` or `spike_compensation` state in the same chain). The two
    are equal for plain SGDM and differ under spike compensation. Updates
    pass through unchanged: this must be the chain's last transform.

    Args:
      horizon: T for the forward (the backward then uses the current
        weights), a pair (T_forward, T_backward), or "spectrain": the
        stage's SpecTrain horizons (eqs 5–6) from `stage`.
      form: "difference" or "velocity".
      learning_rate: η, for the velocity form.
      stage: the `StageInfo` of a pipeline stage, for horizon="spectrain".
    """
    if form not in FORMS:
        raise ConfigError(f"weight_forecast: form={form!r}; use 'difference' or 'velocity'")
    if form == "velocity" and learning_rate is None:
        raise ConfigError("weight_forecast(form='velocity') predicts w − η·T·v: pass "
                          "learning_rate=η, the rate of the chain's optax.scale(-η)")
    horizons = _horizons(horizon, stage)

    def init_fn(params):
        last = optax.tree.zeros_like(params) if form == "difference" else None
        rate = None if learning_rate is None or form == "difference" else jnp.float32(learning_rate)
        return WeightForecastState(jnp.asarray(horizons, jnp.float32), last, rate)

    def update_fn(updates, state, params=None):
        del params
        if form == "difference":
            state = state._replace(last_update=updates)
        return updates, state

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
    return _the_state(opt_state).horizons[1 if backward else 0]


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
    traces = optax.tree.get_all_with_path(opt_state, "trace")
    if len(traces) != 1:
        raise ConfigError(f"forecast(form='velocity') needs one momentum trace in the chain "
                          f"(optax.trace or spike_compensation) and found {len(traces)}; use "
                          "form='difference', which works after any optimizer")
    v = traces[0][1]
    return jax.tree.map(lambda w, u: w - state.learning_rate * T * u.astype(w.dtype), params, v)
