"""Hyper-parameter rules for delayed or resized updates: Chiley et al.'s batch
scaling (as Kosson et al. 2020 use it, eq. 9), its counterpart for Adam (the
square-root rule of Malladi et al. 2022), PipeMare's per-stage
learning-rate rescheduling by delay (Yang et al. 2019, §3), and the decay
schedules the papers train with."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import optax

from pipejax.errors import ConfigError
from pipejax.transforms.adam import AdamW, check_optimizer

LR_SCHEDULES = ("constant", "step", "cosine")


def scale_hyperparams(learning_rate: optax.ScalarOrSchedule, momentum: float, batch: int,
                      new_batch: int) -> tuple[optax.ScalarOrSchedule, float]:
    """(η′, m′) for an update size `new_batch` that keep the momentum's
    half-life in samples and each sample's total contribution:

        m′ = m^(B′/B);   η′ = η·(B′/B)·(1 − m′)/(1 − m)     (Kosson et al. 2020, eq. 9)

    Pipelined backpropagation updates after every micro-batch, so a recipe
    tuned for batch B moves to micro-batch size B′ with this rule. η′ is
    linear in η, so a schedule η(t) scales value by value: η′(t) = η′/η·η(t),
    with t counting the updates at the new batch size.
    """
    if batch < 1 or new_batch < 1:
        raise ConfigError(f"scale_hyperparams: batch={batch} and new_batch={new_batch} must be >= 1")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"scale_hyperparams: momentum={momentum} must lie in [0, 1)")
    r = new_batch / batch
    m = momentum ** r
    factor = r if momentum == 0.0 else r * (1.0 - m) / (1.0 - momentum)
    if callable(learning_rate):
        return (lambda step: factor * learning_rate(step)), float(m)
    return float(learning_rate * factor), float(m)


def scale_adam_hyperparams(learning_rate: optax.ScalarOrSchedule, adam: AdamW, batch: int,
                           new_batch: int) -> tuple[optax.ScalarOrSchedule, AdamW]:
    """(η′, Adam′) for an update size `new_batch`, by the square-root scaling
    rule for Adam (Malladi et al. 2022, "On the SDEs and scaling rules for
    adaptive gradient algorithms", NeurIPS), with κ = B′/B:

        η′ = √κ·η;   1 − β1′ = κ·(1 − β1);   1 − β2′ = κ·(1 − β2);   ε′ = ε/√κ

    and the decoupled weight decay λ′ = √κ·λ, so that the decay per sample,
    η·λ/B, is kept too. Adam's counterpart of `scale_hyperparams` (eq. 9): a
    synchronous recipe moved to the micro-batch of pipelined backpropagation.
    A schedule η(t) scales value by value, t counting the new updates.
    """
    check_optimizer(adam)
    if batch < 1 or new_batch < 1:
        raise ConfigError(f"scale_adam_hyperparams: batch={batch} and new_batch={new_batch} "
                          "must be >= 1")
    k = new_batch / batch
    if k * max(1 - adam.b1, 1 - adam.b2) > 1:
        raise ConfigError(f"scale_adam_hyperparams: {batch} → {new_batch} takes 1 − β past 1 "
                          f"(b1={adam.b1}, b2={adam.b2}); the rule holds for κ(1 − β) <= 1")
    root = k ** 0.5
    scaled = adam._replace(b1=1 - k * (1 - adam.b1), b2=1 - k * (1 - adam.b2),
                           eps=adam.eps / root, weight_decay=adam.weight_decay * root)
    if callable(learning_rate):
        return (lambda step: root * learning_rate(step)), scaled
    return float(root * learning_rate), scaled


def lr_schedule(kind: str, peak: float, total_steps: int, *,
                decay_at: Sequence[float] = (0.5, 0.75), factor: float = 0.1,
                warmup_steps: int = 0) -> optax.Schedule:
    """A learning-rate schedule over `total_steps` updates, peaking at `peak`:

      constant   η
      step       η, multiplied by `factor` at each fraction of training in
                 `decay_at` (He et al. 2016's recipe that Kosson et al. 2020
                 adopt: ×0.1 at 50 % and 75 %)
      cosine     η·½(1 + cos(π·t/T)) (Loshchilov & Hutter 2017)

    with `warmup_steps` of linear warm-up from 0 first (the decay then spans
    the remaining updates).
    """
    if kind not in LR_SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {kind!r}; use one of "
                          f"{', '.join(LR_SCHEDULES)}")
    if total_steps < 1 or not 0 <= warmup_steps < total_steps:
        raise ConfigError(f"lr_schedule: total_steps={total_steps} must be >= 1 and "
                          f"warmup_steps={warmup_steps} in [0, total_steps)")
    if any(not 0.0 < f < 1.0 for f in decay_at):
        raise ConfigError(f"lr_schedule: decay_at={tuple(decay_at)} are fractions of training "
                          "in (0, 1), e.g. 0.5,0.75")
    steps = total_steps - warmup_steps
    if kind == "constant":
        main = optax.constant_schedule(peak)
    elif kind == "step":
        main = optax.piecewise_constant_schedule(
            peak, {int(round(f * steps)): factor for f in sorted(decay_at)})
    else:
        main = optax.cosine_decay_schedule(peak, steps)
    if not warmup_steps:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), main],
                                [warmup_steps])


def pipemare_lr(schedule: optax.ScalarOrSchedule, delay: int,
                warmup_steps: int) -> optax.Schedule:
    """PipeMare's learning rate of a stage with delay τ = `delay`:

        α_{t,τ} = α_t / τ^(p_t),   p_t = 1 − min(t / K_warm, 1)     (Yang et al. 2019, §3)

    At step 0 the rate is divided by the delay; the division fades out over
    `warmup_steps` (K_warm). Use it per stage: `optax.sgd(pipemare_lr(lr,
    s.delay, 1000), 0.9)` in an optimizer function of `StageInfo` s.
    """
    if delay < 0 or warmup_steps < 0:
        raise ConfigError(f"pipemare_lr: delay={delay} and warmup_steps={warmup_steps} must be >= 0")
    base = schedule if callable(schedule) else (lambda _: schedule)
    tau = float(max(delay, 1))

    def rate(step):
        p = 1.0 - jnp.minimum(step / max(warmup_steps, 1), 1.0)
        return base(step) / tau ** p

    return rate
