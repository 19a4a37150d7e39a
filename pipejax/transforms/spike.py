"""Spike compensation: the momentum trace, with the update reshaped to make up
for a delayed gradient (Kosson et al. 2020, §3.3, eqs 10–14).

With a delay of D updates, a gradient that plain momentum would spread over
all later steps (a·v) arrives D steps late; spike compensation applies the
part it missed at once (b·g), so that its total contribution over time is
that of undelayed momentum.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from pipejax.errors import ConfigError


class SpikeCompensationState(NamedTuple):
    """Holds the momentum trace v (named `trace` as in `optax.trace`)."""

    trace: optax.Updates


def coefficients(momentum: float, delay: float, scale: float = 1.0) -> tuple[float, float]:
    """SC_D's (a, b) = (m^D, (1 − m^D)/(1 − m)) with D → scale·D
    (Kosson et al. 2020, eq. 14); a + b = Σ_{j=0..D} m^j."""
    D = scale * delay
    a = momentum ** D
    b = D if momentum == 1.0 else (1.0 - a) / (1.0 - momentum)
    return float(a), float(b)


def _concrete(*values) -> bool:
    """Whether every value is a Python number (not an array traced by
    `optax.inject_hyperparams`, which checks and derives nothing)."""
    return all(isinstance(v, (int, float)) for v in values)


def spike_compensation(momentum: float, delay: float, *, a: float | None = None,
                       b: float | None = None, scale: float = 1.0) -> optax.GradientTransformation:
    """Generalized spike compensation, in place of `optax.trace`:

        v ← m·v + g;   update = a·v + b·g      (Kosson et al. 2020, eqs 10–12)

    Defaults SC_D: a = m^D, b = (1 − m^D)/(1 − m) (eq. 14); `scale=2` gives
    SC_{2D}. Delay 0 is plain momentum (`optax.trace(m)`), delay 1 is
    Nesterov (`optax.trace(m, nesterov=True)`). Follow it with
    `optax.scale(-learning_rate)`.

    Args:
      momentum: m, the trace's decay.
      delay: D, updates between the forward and the backward of a micro-batch
        (a pipeline stage's `StageInfo.delay`).
      a, b: override the coefficients of the trace and of the gradient.
      scale: over-compensation factor on D.

    Every number may be an array, so that `optax.inject_hyperparams` keeps
    them in the state (a sweep then runs one compiled program); give a and
    b then.
    """
    if _concrete(momentum) and not 0.0 <= momentum <= 1.0:
        raise ConfigError(f"spike_compensation: momentum={momentum} must lie in [0, 1]")
    if _concrete(delay, scale) and (delay < 0 or scale < 0):
        raise ConfigError(f"spike_compensation: delay={delay} and scale={scale} must be >= 0")
    if a is None or b is None:
        if not _concrete(momentum, delay, scale):
            raise ConfigError("spike_compensation: with momentum, delay or scale as arrays "
                              "(optax.inject_hyperparams), give a and b too")
        a0, b0 = coefficients(momentum, delay, scale)
        a, b = a0 if a is None else a, b0 if b is None else b

    def init_fn(params):
        return SpikeCompensationState(trace=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        trace = jax.tree.map(lambda g, v: g + momentum * v, updates, state.trace)
        out = jax.tree.map(lambda v, g: a * v + b * g, trace, updates)
        return out, SpikeCompensationState(trace=trace)

    return optax.GradientTransformation(init_fn, update_fn)
