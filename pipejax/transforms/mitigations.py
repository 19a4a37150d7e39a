"""The staleness mitigations by name, for the CLI and the experiments: a
`Recipe` a name, the recipe function of `recipes.py` with the settings it
takes and the optimizer it runs on by default.

  none      SGDM on stale gradients (Kosson et al. 2020, eqs 7–8)   no_mitigation
  stash     SGDM; the backward uses the forward's weights (PipeDream)   stash
  spectrain velocity forecast, forward and backward horizons of the table
            (Chen et al. 2018, eqs 4–6)   spectrain
  lwp       linear weight prediction LWP_D, T = D (Kosson et al. 2020, §3.4)   lwp
  sc        spike compensation SC_D (Kosson et al. 2020, eq. 14)   sc
  lwp+sc    both, the forecast in the velocity form (the paper's default, H.5)   lwp_sc
  pipemare  the learning rate divided by τ^p per stage, p fading over a
            warm-up (Yang et al. 2019, §3)   pipemare
  pipeoptim the forward at w − η·D·ΔW, ΔW the optimizer's own direction
            (Guan et al. 2023; Adam's m̂/(√v̂ + ε))   pipeoptim
  nesterov  NAdam (β1 = 0.99, decoupled decay) on stashed weights
            (Ajanthan et al. 2025)   nesterov
  ef        error feedback on the update, λ = D (Karimireddy et al. 2019;
            for 2BW's delay of one, Zmushko et al. 2026)   ef

Every name but spectrain runs on Adam (`optimizer="adam"` or
`pj.transforms.AdamW(...)`); sc and lwp+sc then compensate Adam's first
moment (`adam_spike_compensation`), and nesterov runs on nothing else. none,
stash and ef, which apply the optimizer's own update, run on Muon too
(`pj.transforms.Muon(...)`).

Kosson et al. train at update size 1 with the hyper-parameters of a
reference batch scaled by their eq. 9; `reference=(η, m, B), batch=B′` does
that here. `sweep=True` builds every SGDM mitigation as one chain whose
numbers live in the optimizer state, so that a sweep compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.adam import Base, check_optimizer, default_form, is_adam
from pipejax.transforms.adam_recipes import NESTEROV, nesterov, pipeoptim
from pipejax.transforms.error_feedback import ef
from pipejax.transforms.recipes import (Mitigation, check_form, check_sweep, lwp, lwp_sc,
                                        no_mitigation, pipemare, sc, spectrain, stash)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A mitigation by name: its recipe function, the settings it takes (its
    keyword arguments) and the optimizer it runs on when none is given."""

    build: Callable[..., Mitigation]
    takes: frozenset[str]
    optimizer: Base = "momentum"

    @property
    def on_adam(self) -> bool:
        """It takes an optimizer, so it runs on Adam too."""
        return "optimizer" in self.takes


_SGDM = frozenset({"learning_rate", "momentum", "reference", "batch"})  # every SGDM recipe's
_FORECAST = _SGDM | {"horizon_scale", "optimizer", "sweep"}
RECIPES: dict[str, Recipe] = {
    "none": Recipe(no_mitigation, _SGDM | {"optimizer", "sweep"}),
    "stash": Recipe(stash, _SGDM | {"optimizer", "sweep"}),
    "spectrain": Recipe(spectrain, _SGDM | {"horizon_scale", "sweep"}),
    "lwp": Recipe(lwp, _FORECAST | {"form"}),
    "sc": Recipe(sc, _FORECAST),
    "lwp+sc": Recipe(lwp_sc, _FORECAST | {"form"}),
    "pipemare": Recipe(pipemare, _SGDM | {"warmup_steps", "optimizer"}),
    "pipeoptim": Recipe(pipeoptim, _SGDM | {"horizon_scale", "optimizer"}, "adam"),
    "nesterov": Recipe(nesterov, frozenset({"learning_rate", "optimizer", "momentum_decay"}),
                       NESTEROV),
    "ef": Recipe(ef, _SGDM | {"horizon_scale", "optimizer"})}
MITIGATIONS = tuple(RECIPES)
# settings left to the recipe's own default when not given
_OWN_DEFAULT = ("optimizer", "form", "momentum_decay")
# settings a recipe that does not take them refuses; the others (horizon_scale,
# warmup_steps) are left out, as the CLI passes them to every name
_CHECKED = ("momentum", "reference", "batch", "form", "momentum_decay", "sweep")


def mitigation(name: str, learning_rate: optax.ScalarOrSchedule | None = None, *,
               momentum: float | None = None, reference: tuple | None = None,
               batch: int | None = None, horizon_scale: float = 1.0,
               optimizer: Base | None = None, form: str | None = None,
               warmup_steps: int | None = None, momentum_decay: float | None = None,
               sweep: bool = False) -> Mitigation:
    """`RECIPES[name](...)`, given the settings that recipe takes. Of the
    others, `horizon_scale` and `warmup_steps` are left out (so that one call
    serves every name); any other given to a recipe that does not take it
    (`momentum` to nesterov, `sweep` to pipemare, ...) is a ConfigError.

    Args:
      name: one of `MITIGATIONS`.
      learning_rate, momentum, reference, batch: as the recipes take them.
      horizon_scale: for spectrain, lwp, sc, lwp+sc and pipeoptim.
      optimizer: "momentum", "adam", `pj.transforms.AdamW(...)` (every name
        but spectrain on Adam, nesterov on nothing else) or
        `pj.transforms.Muon(...)` (none, stash and ef); default the
        recipe's own ("momentum"; "adam" for pipeoptim; Ajanthan et al.'s
        AdamW for nesterov).
      form: for lwp and lwp+sc: "velocity" (the default on SGDM) or
        "difference" (the default, and the only one, on Adam).
      warmup_steps: for pipemare, K_warm >= 1.
      momentum_decay: for nesterov, ψ of NAdam's momentum schedule.
      sweep: the sweep chain, for the SGDM names but pipemare, in the velocity form.
    """
    if name not in RECIPES:
        raise ConfigError(f"unknown mitigation {name!r}; choose one of {', '.join(MITIGATIONS)}")
    recipe = RECIPES[name]
    takes = recipe.takes
    base = optimizer if optimizer is not None else recipe.optimizer
    check_optimizer(base, name)
    if is_adam(base) and not recipe.on_adam:
        on_adam = ", ".join(n for n, r in RECIPES.items() if r.on_adam)
        raise ConfigError(f"mitigation {name!r} forecasts with a momentum trace, which Adam does "
                          f"not have; with Adam use {on_adam}")
    if form is not None:
        check_form(form, "momentum")  # a form at all; whether it fits the optimizer, below
    given = {"learning_rate": learning_rate, "momentum": momentum, "reference": reference,
             "batch": batch, "horizon_scale": horizon_scale, "optimizer": optimizer,
             "form": form, "warmup_steps": warmup_steps, "momentum_decay": momentum_decay,
             "sweep": sweep}
    ignored = [key for key in _CHECKED if key not in takes and given[key] not in (None, False)]
    if ignored:
        raise ConfigError(f"mitigation {name!r} takes no {', '.join(ignored)}; leave "
                          f"{'it' if len(ignored) == 1 else 'them'} out")
    if "form" in takes:
        check_form(form or default_form(base), base)
    if "sweep" in takes:
        check_sweep(name, base, form or default_form(base), sweep)
    return recipe.build(**{key: value for key, value in given.items()
                           if key in takes and not (value is None and key in _OWN_DEFAULT)})
