"""The staleness mitigations of the papers as ready optimizer functions
`StageInfo -> optax chain`, by name (for the CLI and the experiments).

  none      SGDM on stale gradients (Kosson et al. 2020, eqs 7–8)
  stash     SGDM; the backward uses the forward's weights (PipeDream)
  spectrain velocity forecast, forward and backward horizons of the table
            (Chen et al. 2018, eqs 4–6)
  lwp       linear weight prediction LWP_D, T = D (Kosson et al. 2020, §3.4)
  sc        spike compensation SC_D (Kosson et al. 2020, eq. 14)
  lwp+sc    both, the forecast in the difference form
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.forecast import weight_forecast
from pipejax.transforms.spike import spike_compensation

MITIGATIONS = ("none", "stash", "spectrain", "lwp", "sc", "lwp+sc")


class Mitigation(NamedTuple):
    """An optimizer function for `pipe.trainer`, and whether the pipeline must stash weights."""

    optimizer: Callable  # StageInfo -> optax.GradientTransformation
    weight_stashing: bool


def mitigation(name: str, learning_rate: float, *, momentum: float = 0.9,
               horizon_scale: float = 1.0, optimizer: str = "momentum") -> Mitigation:
    """The named mitigation on SGDM (`optimizer="momentum"`, v ← m·v + g,
    w ← w − η·v) or on Adam (`optimizer="adam"`: none, stash or lwp, the
    forecast in the difference form). `horizon_scale` multiplies the
    forecast horizon and the compensated delay (2 gives LWP_2D, SC_2D)."""
    if name not in MITIGATIONS:
        raise ConfigError(f"unknown mitigation {name!r}; choose one of {', '.join(MITIGATIONS)}")
    if optimizer not in ("momentum", "adam"):
        raise ConfigError(f"mitigation optimizer {optimizer!r}; use 'momentum' or 'adam'")
    if optimizer == "adam" and name not in ("none", "stash", "lwp"):
        raise ConfigError(f"mitigation {name!r} rewrites the momentum trace; with Adam use "
                          "none, stash or lwp (the difference-form forecast)")
    h, lr = horizon_scale, learning_rate
    base = (lambda: optax.adam(lr)) if optimizer == "adam" else (
        lambda: optax.chain(optax.trace(momentum), optax.scale(-lr)))

    def make(s) -> optax.GradientTransformation:
        if name in ("none", "stash"):
            return base()
        if name == "spectrain":
            horizons = (h * s.forward_horizon, h * s.backward_horizon)
            return optax.chain(base(), weight_forecast(horizons, form="velocity", learning_rate=lr))
        if name == "lwp":
            return optax.chain(base(), weight_forecast(h * s.delay))
        sc = optax.chain(spike_compensation(momentum, s.delay, scale=h), optax.scale(-lr))
        return sc if name == "sc" else optax.chain(sc, weight_forecast(h * s.delay))

    return Mitigation(make, name == "stash")
