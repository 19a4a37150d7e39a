"""The staleness mitigations by name, for the CLI and the experiments: a
lookup over the recipe functions of `recipes.py`.

  none      SGDM on stale gradients (Kosson et al. 2020, eqs 7–8)   no_mitigation
  stash     SGDM; the backward uses the forward's weights (PipeDream)   stash
  spectrain velocity forecast, forward and backward horizons of the table
            (Chen et al. 2018, eqs 4–6)   spectrain
  lwp       linear weight prediction LWP_D, T = D (Kosson et al. 2020, §3.4)   lwp
  sc        spike compensation SC_D (Kosson et al. 2020, eq. 14)   sc
  lwp+sc    both, the forecast in the velocity form (the paper's default, H.5)   lwp_sc
  pipemare  the learning rate divided by τ^p per stage, p fading over a
            warm-up (Yang et al. 2019, §3)   pipemare

Kosson et al. train at update size 1 with the hyper-parameters of a
reference batch scaled by their eq. 9; `reference=(η, m, B), batch=B′` does
that here. `sweep=True` builds every SGDM mitigation as one chain whose
numbers live in the optimizer state, so that a sweep compiles once.
"""

from __future__ import annotations

import inspect
from typing import Callable

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.recipes import (Mitigation, check_form, check_optimizer, check_sweep,
                                        lwp, lwp_sc, no_mitigation, pipemare, sc, spectrain,
                                        stash)

RECIPES: dict[str, Callable[..., Mitigation]] = {
    "none": no_mitigation, "stash": stash, "spectrain": spectrain, "lwp": lwp, "sc": sc,
    "lwp+sc": lwp_sc, "pipemare": pipemare}
MITIGATIONS = tuple(RECIPES)
# the ones that run on Adam: they do not rewrite a momentum trace
_ADAM = tuple(name for name, recipe in RECIPES.items()
              if "optimizer" in inspect.signature(recipe).parameters)


def mitigation(name: str, learning_rate: optax.ScalarOrSchedule | None = None, *,
               momentum: float | None = None, reference: tuple | None = None,
               batch: int | None = None, horizon_scale: float = 1.0,
               optimizer: str = "momentum", form: str | None = None,
               warmup_steps: int | None = None, sweep: bool = False) -> Mitigation:
    """`RECIPES[name](...)`, given the settings that recipe takes; the others
    are checked and left out (`horizon_scale` on "none", `warmup_steps` off
    "pipemare", ...), so that one call serves every name.

    Args:
      name: one of `MITIGATIONS`.
      learning_rate, momentum, reference, batch: as the recipes take them.
      horizon_scale: for spectrain, lwp, sc and lwp+sc.
      optimizer: "momentum" (every name) or "adam" (none, stash, lwp, pipemare).
      form: for lwp and lwp+sc: "velocity" (the default on SGDM) or
        "difference" (the default, and the only one, on Adam).
      warmup_steps: for pipemare, K_warm >= 1.
      sweep: the sweep chain, for every name but pipemare, in the velocity form.
    """
    if name not in RECIPES:
        raise ConfigError(f"unknown mitigation {name!r}; choose one of {', '.join(MITIGATIONS)}")
    check_optimizer(optimizer)
    if optimizer == "adam" and name not in _ADAM:
        raise ConfigError(f"mitigation {name!r} rewrites the momentum trace; with Adam use "
                          f"{', '.join(_ADAM)}")
    form = form or ("difference" if optimizer == "adam" else "velocity")
    check_form(form, optimizer)
    check_sweep(name, optimizer, form, sweep)
    given = {"learning_rate": learning_rate, "momentum": momentum, "reference": reference,
             "batch": batch, "horizon_scale": horizon_scale, "optimizer": optimizer,
             "form": form, "warmup_steps": warmup_steps, "sweep": sweep}
    takes = inspect.signature(RECIPES[name]).parameters
    return RECIPES[name](**{key: value for key, value in given.items() if key in takes})
