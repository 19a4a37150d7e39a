"""The Adam-era recipes: PipeOptim's forecast with the optimizer's own
direction (Guan et al. 2023) and the Nesterov method's NAdam on stashed
weights (Ajanthan et al. 2025), as `Mitigation`s like those of `recipes.py`.
"""

from __future__ import annotations

import optax

from pipejax.errors import ConfigError
from pipejax.transforms.adam import (AdamW, Base, as_adamw, base_optimizer, check_optimizer,
                                     is_adam)
from pipejax.transforms.recipes import Mitigation, forecast_ahead, rate_and_momentum


def pipeoptim(learning_rate: optax.ScalarOrSchedule | None = None, *,
              momentum: float | None = None, reference: tuple | None = None,
              batch: int | None = None, horizon_scale: float = 1.0,
              optimizer: Base = "adam") -> Mitigation:
    """PipeOptim (Guan et al. 2023, arXiv 2312.00839): the forward at the
    weights predicted with the optimizer's own direction,

        ŵ = w − η·s·ΔW_t,   s = horizon_scale·D

    ΔW_t = m̂_t/(√v̂_t + ε) for Adam and AdamW (the weight decay left out, as
    in the paper's table), the momentum trace v for SGDM (where this is
    `lwp` in the velocity form); η of the last update. The backward uses the
    current weights. Their code predicts s = D + 1 updates ahead; D (the
    updates between the forward and the backward, the paper's s) is the
    default here.

    The arguments not listed are `lwp`'s.

    Args:
      optimizer: "adam" (optax.adam, the default), `AdamW(...)` or "momentum".
    """
    check_optimizer(optimizer)
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)
    if is_adam(optimizer):
        base = lambda: as_adamw(optimizer)(lr, direction=True)  # ΔW: Adam's, kept
    else:
        base = lambda: base_optimizer(optimizer, lr, m)  # ΔW: the momentum trace
    return Mitigation(lambda s: optax.chain(base(), forecast_ahead(horizon_scale * s.delay,
                                                                   "velocity", lr)), False, lr, m)


NESTEROV = AdamW(b1=0.99, b2=0.999, eps=1e-8, weight_decay=0.01)  # Ajanthan et al.'s settings


def nesterov(learning_rate: optax.ScalarOrSchedule | None = None, *,
             optimizer: Base = NESTEROV, momentum_decay: float = 0.004) -> Mitigation:
    """The Nesterov method for asynchronous pipelines as Ajanthan et al. 2025
    run it (ICML, arXiv 2505.01099; github.com/PluralisResearch/AsyncPP):
    NAdam with decoupled weight decay (`scale_by_nadam`: the look-ahead
    μ_{t+1}·m, the stale gradient's own weight discounted to 1 − μ_t), with
    weight stashing, so that each gradient is that of the weights its forward
    used, applied to the current ones.

    Args:
      learning_rate: η, a float or an optax schedule.
      optimizer: `AdamW(...)` for β1, β2, ε and the decay (default theirs:
        β1 = 0.99, β2 = 0.999, ε = 1e-8, weight decay 0.01); "adam" is
        `AdamW()` (β1 = 0.9, no decay).
      momentum_decay: ψ of torch's momentum schedule μ_t = β1·(1 − ½·0.96^(tψ)).
    """
    check_optimizer(optimizer)
    if not is_adam(optimizer):
        raise ConfigError("mitigation 'nesterov' is NAdam on stashed weights; give "
                          "optimizer=pj.transforms.AdamW(...) (or leave it out for the paper's "
                          f"β1 = 0.99, weight decay 0.01), not {optimizer!r}")
    if learning_rate is None:
        raise ConfigError("mitigation 'nesterov': give learning_rate=η")
    adam = as_adamw(optimizer)
    return Mitigation(lambda s: adam.nadam(learning_rate, momentum_decay), True, learning_rate,
                      adam.b1)
