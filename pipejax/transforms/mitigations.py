"""The staleness mitigations of the papers as ready optimizer functions
`StageInfo -> optax chain`, by name (for the CLI and the experiments).

  none      SGDM on stale gradients (Kosson et al. 2020, eqs 7–8)
  stash     SGDM; the backward uses the forward's weights (PipeDream)
  spectrain velocity forecast, forward and backward horizons of the table
            (Chen et al. 2018, eqs 4–6)
  lwp       linear weight prediction LWP_D, T = D (Kosson et al. 2020, §3.4)
  sc        spike compensation SC_D (Kosson et al. 2020, eq. 14)
  lwp+sc    both, the forecast in the velocity form (the paper's default, H.5)
  pipemare  the learning rate divided by τ^p per stage, p fading over a
            warm-up (Yang et al. 2019, §3)

Kosson et al. train at update size 1 with the hyper-parameters of a
reference batch scaled by their eq. 9; `reference=(η, m, B), batch=B′` does
that here. `sweep=True` builds every SGDM mitigation as one chain whose
numbers live in the optimizer state, so that a sweep compiles once.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.forecast import FORMS, weight_forecast
from pipejax.transforms.hyperparams import pipemare_lr, scale_hyperparams
from pipejax.transforms.spike import coefficients, spike_compensation

MITIGATIONS = ("none", "stash", "spectrain", "lwp", "sc", "lwp+sc", "pipemare")
_ADAM = ("none", "stash", "lwp", "pipemare")  # the ones that do not rewrite a momentum trace


class Mitigation(NamedTuple):
    """An optimizer function for `pipe.trainer` or `pj.simulate`, whether the
    pipeline must stash weights, and the rate and momentum it uses (after
    scaling, when a reference was given)."""

    optimizer: Callable  # StageInfo -> optax.GradientTransformation
    weight_stashing: bool
    learning_rate: optax.ScalarOrSchedule
    momentum: float


def _rate_and_momentum(learning_rate, momentum, reference, batch, optimizer):
    """(η, m): as given, or scaled from `reference` = (η, m, B) to `batch` by eq. 9."""
    if reference is None:
        if learning_rate is None:
            raise ConfigError("mitigation: give learning_rate=η, or reference=(η, m, B) and "
                              "batch=B′ to scale a reference recipe (Kosson et al. eq. 9)")
        if batch is not None:
            raise ConfigError("mitigation: batch= is the update size to scale a reference "
                              "recipe to; give reference=(η, m, B) with it")
        return learning_rate, 0.9 if momentum is None else momentum
    if learning_rate is not None or momentum is not None:
        raise ConfigError("mitigation: reference=(η, m, B) sets the learning rate and momentum "
                          "(eq. 9); leave learning_rate and momentum out, or drop reference")
    if optimizer != "momentum":
        raise ConfigError("mitigation: reference scaling (eq. 9) is a rule for SGD with momentum; "
                          f"optimizer={optimizer!r} takes learning_rate= directly")
    if not (isinstance(reference, (tuple, list)) and len(reference) == 3):
        raise ConfigError(f"mitigation: reference={reference!r}; give (learning rate, momentum, "
                          "batch size) of the recipe to scale, e.g. (0.1, 0.9, 128)")
    if batch is None:
        raise ConfigError("mitigation: reference=(η, m, B) needs batch=B′, the update size (the "
                          "micro-batch size of an asynchronous pipeline)")
    return scale_hyperparams(reference[0], reference[1], int(reference[2]), int(batch))


def _family(momentum, a, b, learning_rate, forward, backward) -> optax.GradientTransformation:
    """v ← m·v + g; w ← w − η·(a·v + b·g); forecasts w − η·T·v with T = forward
    (of the forward) and backward: every SGDM mitigation, by its numbers."""
    return optax.chain(spike_compensation(momentum, 0, a=a, b=b),
                       optax.scale_by_learning_rate(learning_rate),
                       weight_forecast((forward, backward), form="velocity",
                                       learning_rate=learning_rate))


def _numbers(name: str, s, m: float, h: float) -> dict:
    """The family's (a, b, T_forward, T_backward) that make mitigation `name` at stage `s`."""
    a, b = coefficients(m, s.delay, h) if name in ("sc", "lwp+sc") else (1.0, 0.0)
    forward = h * s.delay if name in ("lwp", "lwp+sc") else (
        h * s.forward_horizon if name == "spectrain" else 0.0)
    backward = h * s.backward_horizon if name == "spectrain" else 0.0
    return {"a": a, "b": b, "forward": float(forward), "backward": float(backward)}


def mitigation(name: str, learning_rate: optax.ScalarOrSchedule | None = None, *,
               momentum: float | None = None, reference: tuple | None = None,
               batch: int | None = None, horizon_scale: float = 1.0,
               optimizer: str = "momentum", form: str | None = None,
               warmup_steps: int | None = None, sweep: bool = False) -> Mitigation:
    """The named mitigation on SGDM (`optimizer="momentum"`: v ← m·v + g,
    w ← w − η·v) or on Adam (`optimizer="adam"`: none, stash, lwp in the
    difference form, pipemare).

    Args:
      name: one of `MITIGATIONS`.
      learning_rate: η, a float or an optax schedule of the update count
        (the forecasts follow it).
      momentum: m (default 0.9).
      reference: (η, m, B) of a recipe tuned at batch B; with `batch` = B′,
        η and m are scaled by Kosson et al.'s eq. 9 (`scale_hyperparams`).
        η may be a schedule; its values scale, its steps are this run's updates.
      batch: the update size B′ (an asynchronous pipeline's micro-batch size).
      horizon_scale: multiplies the forecast horizon and the compensated
        delay (2 gives LWP_2D, SC_2D).
      form: the forecast's form for lwp and lwp+sc: "velocity" (the default
        on SGDM, Kosson et al. H.5) or "difference" (the only one on Adam).
      warmup_steps: PipeMare's K_warm, in updates (pipemare only).
      sweep: build the SGDM mitigations (all but pipemare, velocity form) as
        one chain, `optax.inject_hyperparams` of v ← m·v + g, w ← w −
        η·(a·v + b·g) and a forecast with horizons (T_f, T_b), with every
        number in the state: the same compiled program serves every name,
        delay and momentum of a sweep (with JAX's persistent compilation
        cache, across `pj.simulate` instances and processes). The updates
        equal the named chains'; the names without a forecast pay one (of
        horizon 0).
    """
    if name not in MITIGATIONS:
        raise ConfigError(f"unknown mitigation {name!r}; choose one of {', '.join(MITIGATIONS)}")
    if optimizer not in ("momentum", "adam"):
        raise ConfigError(f"mitigation optimizer {optimizer!r}; use 'momentum' or 'adam'")
    if optimizer == "adam" and name not in _ADAM:
        raise ConfigError(f"mitigation {name!r} rewrites the momentum trace; with Adam use "
                          f"{', '.join(_ADAM)}")
    form = form or ("difference" if optimizer == "adam" else "velocity")
    if form not in FORMS:
        raise ConfigError(f"mitigation: form={form!r}; use 'velocity' or 'difference'")
    if optimizer == "adam" and form == "velocity":
        raise ConfigError("mitigation: the velocity form reads a momentum trace, which Adam does "
                          "not have; use form='difference' with Adam")
    if name == "pipemare" and (warmup_steps is None or warmup_steps < 1):
        raise ConfigError(f"mitigation 'pipemare' divides the rate by τ^p with p fading over "
                          f"K_warm updates; give warmup_steps=K_warm >= 1, not {warmup_steps!r}")
    if sweep and (optimizer != "momentum" or name == "pipemare" or form != "velocity"):
        raise ConfigError(f"mitigation(sweep=True) builds the SGDM mitigations in the velocity "
                          f"form; {name!r} on {optimizer!r} with form={form!r} is not one of them")
    lr, m = _rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    h = horizon_scale

    def base(rate=lr) -> optax.GradientTransformation:
        if optimizer == "adam":
            return optax.adam(rate)
        return optax.chain(optax.trace(m), optax.scale_by_learning_rate(rate))

    def lwp(T: float) -> optax.GradientTransformation:
        return weight_forecast(T, form=form, learning_rate=lr if form == "velocity" else None)

    def make(s) -> optax.GradientTransformation:
        if sweep:
            return optax.inject_hyperparams(_family)(momentum=m, learning_rate=lr,
                                                     **_numbers(name, s, m, h))
        if name in ("none", "stash"):
            return base()
        if name == "pipemare":
            return base(pipemare_lr(lr, s.delay, warmup_steps))
        if name == "spectrain":
            horizons = (h * s.forward_horizon, h * s.backward_horizon)
            return optax.chain(base(), weight_forecast(horizons, form="velocity", learning_rate=lr))
        if name == "lwp":
            return optax.chain(base(), lwp(h * s.delay))
        sc = optax.chain(spike_compensation(m, s.delay, scale=h), optax.scale_by_learning_rate(lr))
        return sc if name == "sc" else optax.chain(sc, lwp(h * s.delay))

    return Mitigation(make, name == "stash", lr, m)
