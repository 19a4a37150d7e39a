"""The staleness mitigations of the papers, one function per recipe: each
returns a `Mitigation`, an optimizer function `StageInfo -> optax chain` with
what the pipeline must do around it.

Every recipe takes the learning rate η (a float or an optax schedule) and the
momentum m, or `reference=(η, m, B), batch=B′` to scale a recipe tuned at
batch B to the update size B′ (Kosson et al. 2020, eq. 9). The SGDM recipes
take `sweep=True`: one chain, `optax.inject_hyperparams` of
v ← m·v + g, w ← w − η·(a·v + b·g) with a forecast of horizons (T_f, T_b),
with every number in the optimizer state, so that a sweep over recipes,
delays and momenta compiles once. Its updates equal the recipe's own chain;
a recipe without a forecast pays one of horizon 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.adam import (Base, base_optimizer, check_optimizer, default_form, is_adam,
                                     own_momentum)
from pipejax.transforms.muon import Muon
from pipejax.transforms.forecast import FORMS, weight_forecast
from pipejax.transforms.hyperparams import pipemare_lr, scale_hyperparams
from pipejax.transforms.spike import coefficients, spike_compensation

if TYPE_CHECKING:
    from pipejax.schedules.schedule import StageInfo

Optimizer = Callable[["StageInfo"], optax.GradientTransformation]


class Mitigation(NamedTuple):
    """An optimizer function for `pipe.trainer` or `pj.simulate`, whether the
    pipeline must stash weights, and the rate and momentum it uses (after
    scaling, when a reference was given)."""

    optimizer: Optimizer
    weight_stashing: bool
    learning_rate: optax.ScalarOrSchedule
    momentum: float


def rate_and_momentum(learning_rate: optax.ScalarOrSchedule | None, momentum: float | None,
                       reference: tuple | None, batch: int | None,
                       optimizer: Base) -> tuple[optax.ScalarOrSchedule, float]:
    """(η, m): as given, or scaled from `reference` = (η, m, B) to `batch` by
    eq. 9; on Adam m is its β1, on Muon its beta."""
    own = own_momentum(optimizer)
    if own is not None and momentum is not None:
        name, field = ("Muon", "beta") if isinstance(optimizer, Muon) else ("AdamW", "b1")
        raise ConfigError(f"mitigation: momentum={momentum} on {name}, whose momentum is its "
                          f"{field}; leave momentum out and give optimizer=pj.transforms."
                          f"{name}({field}=...)")
    if reference is None:
        if learning_rate is None:
            raise ConfigError("mitigation: give learning_rate=η, or reference=(η, m, B) and "
                              "batch=B′ to scale a reference recipe (Kosson et al. eq. 9)")
        if batch is not None:
            raise ConfigError("mitigation: batch= is the update size to scale a reference "
                              "recipe to; give reference=(η, m, B) with it")
        if own is not None:
            return learning_rate, own
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


def check_form(form: str, optimizer: Base) -> None:
    if form not in FORMS:
        raise ConfigError(f"mitigation: form={form!r}; use 'velocity' or 'difference'")
    if is_adam(optimizer) and form == "velocity":
        raise ConfigError("mitigation: the velocity form reads a momentum trace, which Adam does "
                          "not have; use form='difference' with Adam")


def check_sweep(name: str, optimizer: Base, form: str, sweep: bool) -> None:
    if sweep and (optimizer != "momentum" or name == "pipemare" or form != "velocity"):
        raise ConfigError(f"mitigation(sweep=True) builds the SGDM mitigations in the velocity "
                          f"form; {name!r} on {optimizer!r} with form={form!r} is not one of them")


def _family(momentum, a, b, learning_rate, forward, backward) -> optax.GradientTransformation:
    """v ← m·v + g; w ← w − η·(a·v + b·g); forecasts w − η·T·v with T = forward
    (of the forward) and backward: every SGDM recipe, by its numbers."""
    return optax.chain(spike_compensation(momentum, 0, a=a, b=b),
                       optax.scale_by_learning_rate(learning_rate),
                       weight_forecast((forward, backward), form="velocity",
                                       learning_rate=learning_rate))


def _swept(lr: optax.ScalarOrSchedule, m: float,
           numbers: Callable[[StageInfo], tuple[float, float, float, float]]) -> Optimizer:
    """The sweep chain with the recipe's (a, b, T_forward, T_backward) at each stage."""
    def make(s: StageInfo) -> optax.GradientTransformation:
        a, b, forward, backward = numbers(s)
        return optax.inject_hyperparams(_family)(momentum=m, learning_rate=lr, a=a, b=b,
                                                 forward=float(forward), backward=float(backward))
    return make


def forecast_ahead(T: float, form: str, lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """The forecast T updates ahead: w − η·T·v or w + T·(w − w_prev)."""
    return weight_forecast(T, form=form, learning_rate=lr if form == "velocity" else None)


def _sc(optimizer: Base, m: float, delay: float, h: float,
        lr: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """SC with D → h·D at rate η: w ← w − η·(a·v + b·g), or SC_{hD} on Adam's
    first moment (`adam_spike_compensation`)."""
    if is_adam(optimizer):
        return base_optimizer(optimizer, lr, m, h * delay)
    return optax.chain(spike_compensation(m, delay, scale=h), optax.scale_by_learning_rate(lr))


def _plain(name: str, learning_rate: optax.ScalarOrSchedule | None, momentum: float | None,
           reference: tuple | None, batch: int | None, optimizer: Base, sweep: bool) -> Mitigation:
    """`no_mitigation` or `stash`: the base optimizer, with or without stashing."""
    check_optimizer(optimizer, name)
    check_sweep(name, optimizer, default_form(optimizer), sweep)
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    make = _swept(lr, m, lambda s: (1.0, 0.0, 0.0, 0.0)) if sweep else (
        lambda s: base_optimizer(optimizer, lr, m))
    return Mitigation(make, name == "stash", lr, m)


def no_mitigation(learning_rate: optax.ScalarOrSchedule | None = None, *,
                  momentum: float | None = None, reference: tuple | None = None,
                  batch: int | None = None, optimizer: Base = "momentum",
                  sweep: bool = False) -> Mitigation:
    """SGDM on stale gradients, the baseline (Kosson et al. 2020, eqs 7–8):

        v ← m·v + g(w_{t−D});   w ← w − η·v

    or Adam (`optimizer="adam"`) on them.

    Args:
      learning_rate: η, a float or an optax schedule of the update count.
      momentum: m (default 0.9).
      reference: (η, m, B) of a recipe tuned at batch B; with `batch` = B′,
        η and m are scaled by Kosson et al.'s eq. 9 (`scale_hyperparams`).
      batch: the update size B′ (an asynchronous pipeline's micro-batch size).
      optimizer: "momentum" (SGDM), "adam" (optax.adam), `AdamW(...)` or `Muon(...)`.
      sweep: the sweep chain (SGDM only; see the module docstring).
    """
    return _plain("none", learning_rate, momentum, reference, batch, optimizer, sweep)


def stash(learning_rate: optax.ScalarOrSchedule | None = None, *, momentum: float | None = None,
          reference: tuple | None = None, batch: int | None = None,
          optimizer: Base = "momentum", sweep: bool = False) -> Mitigation:
    """PipeDream's weight stashing (Chen et al. 2018, §3.2): the update of
    `no_mitigation`, v ← m·v + g(w_{t−D}); w ← w − η·v, with the backward of a
    micro-batch at the weights w_{t−D} its forward used. Args as `no_mitigation`.
    """
    return _plain("stash", learning_rate, momentum, reference, batch, optimizer, sweep)


def spectrain(learning_rate: optax.ScalarOrSchedule | None = None, *,
              momentum: float | None = None, reference: tuple | None = None,
              batch: int | None = None, horizon_scale: float = 1.0,
              sweep: bool = False) -> Mitigation:
    """SpecTrain (Chen et al. 2018, eqs 4–6): SGDM, with the forward and the
    backward at the velocity forecast of the weights they will meet,

        ŵ = w − s·η·v,   s = T_f (forward) or T_b (backward),

    T_f, T_b the stage's `forward_horizon` and `backward_horizon` from the
    schedule's table (eqs 5–6 for PipeDream's), times `horizon_scale`.
    Other args as `no_mitigation`.
    """
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, "momentum")
    h = horizon_scale
    if sweep:
        return Mitigation(_swept(lr, m, lambda s: (1.0, 0.0, h * s.forward_horizon,
                                                   h * s.backward_horizon)), False, lr, m)

    def make(s: StageInfo) -> optax.GradientTransformation:
        horizons = (h * s.forward_horizon, h * s.backward_horizon)
        return optax.chain(base_optimizer("momentum", lr, m),
                           weight_forecast(horizons, form="velocity", learning_rate=lr))

    return Mitigation(make, False, lr, m)


def lwp(learning_rate: optax.ScalarOrSchedule | None = None, *, momentum: float | None = None,
        reference: tuple | None = None, batch: int | None = None, horizon_scale: float = 1.0,
        optimizer: Base = "momentum", form: str | None = None,
        sweep: bool = False) -> Mitigation:
    """Linear weight prediction LWP_D (Kosson et al. 2020, §3.4): the base
    optimizer, with the forward at the weights forecast T = D updates ahead,

        ŵ = w − η·T·v   (velocity form)   or   ŵ = w + T·(w − w_prev)   (difference form).

    The arguments not listed are `no_mitigation`'s.

    Args:
      horizon_scale: T = horizon_scale·D (2 gives LWP_2D).
      optimizer: "momentum" (SGDM), "adam" (optax.adam) or `AdamW(...)`.
      form: "velocity" (the default on SGDM, Kosson et al. H.5) or
        "difference" (the default, and the only one, on Adam).
    """
    check_optimizer(optimizer)
    form = form or default_form(optimizer)
    check_form(form, optimizer)
    check_sweep("lwp", optimizer, form, sweep)
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    h = horizon_scale
    if sweep:
        return Mitigation(_swept(lr, m, lambda s: (1.0, 0.0, h * s.delay, 0.0)), False, lr, m)
    return Mitigation(lambda s: optax.chain(base_optimizer(optimizer, lr, m),
                                            forecast_ahead(h * s.delay, form, lr)),
                      False, lr, m)


def sc(learning_rate: optax.ScalarOrSchedule | None = None, *, momentum: float | None = None,
       reference: tuple | None = None, batch: int | None = None, horizon_scale: float = 1.0,
       optimizer: Base = "momentum", sweep: bool = False) -> Mitigation:
    """Spike compensation SC_D (Kosson et al. 2020, eq. 14):

        v ← m·v + g;   w ← w − η·(a·v + b·g),   a = m^D,  b = (1 − m^D)/(1 − m)

    with D → horizon_scale·D (2 gives SC_2D); on Adam, the same on its first
    moment (`adam_spike_compensation`). Other args as `no_mitigation`.
    """
    check_optimizer(optimizer)
    check_sweep("sc", optimizer, default_form(optimizer), sweep)
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    h = horizon_scale
    if sweep:
        return Mitigation(_swept(lr, m, lambda s: (*coefficients(m, s.delay, h), 0.0, 0.0)),
                          False, lr, m)
    return Mitigation(lambda s: _sc(optimizer, m, s.delay, h, lr), False, lr, m)


def lwp_sc(learning_rate: optax.ScalarOrSchedule | None = None, *,
           momentum: float | None = None, reference: tuple | None = None,
           batch: int | None = None, horizon_scale: float = 1.0,
           optimizer: Base = "momentum", form: str | None = None,
           sweep: bool = False) -> Mitigation:
    """LWP_D and SC_D together, the paper's default in the velocity form
    (Kosson et al. 2020, H.5):

        v ← m·v + g;   w ← w − η·(a·v + b·g);   ŵ = w − η·D·v

    (`form="difference"`: ŵ = w + D·(w − w_prev), the form on Adam, whose
    first moment then carries SC_D as in `sc`); a, b as in `sc`, D →
    horizon_scale·D in both. Other args as `lwp`.
    """
    check_optimizer(optimizer)
    form = form or default_form(optimizer)
    check_form(form, optimizer)
    check_sweep("lwp+sc", optimizer, form, sweep)
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    h = horizon_scale
    if sweep:
        return Mitigation(_swept(lr, m, lambda s: (*coefficients(m, s.delay, h), h * s.delay,
                                                   0.0)), False, lr, m)
    return Mitigation(lambda s: optax.chain(_sc(optimizer, m, s.delay, h, lr),
                                            forecast_ahead(h * s.delay, form, lr)), False, lr, m)


def pipemare(learning_rate: optax.ScalarOrSchedule | None = None, *, warmup_steps: int,
             momentum: float | None = None, reference: tuple | None = None,
             batch: int | None = None, optimizer: Base = "momentum") -> Mitigation:
    """PipeMare's learning-rate rescheduling (Yang et al. 2019, §3): the base
    optimizer at stage rate

        η_t / τ^(p_t),   p_t = 1 − min(t / K_warm, 1),   τ = max(D, 1)

    (`pipemare_lr`). No sweep form: the rate is a schedule per stage.

    The arguments not listed are `no_mitigation`'s.

    Args:
      warmup_steps: K_warm >= 1, in updates.
      optimizer: "momentum" (SGDM), "adam" (optax.adam) or `AdamW(...)`.
    """
    check_optimizer(optimizer)
    if warmup_steps is None or warmup_steps < 1:
        raise ConfigError(f"mitigation 'pipemare' divides the rate by τ^p with p fading over "
                          f"K_warm updates; give warmup_steps=K_warm >= 1, not {warmup_steps!r}")
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    return Mitigation(lambda s: base_optimizer(optimizer, pipemare_lr(lr, s.delay, warmup_steps),
                                               m),
                      False, lr, m)

