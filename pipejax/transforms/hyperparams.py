"""Hyper-parameter rules for delayed or resized updates: Chiley et al.'s batch
scaling (as Kosson et al. 2020 use it, eq. 9) and PipeMare's per-stage
learning-rate rescheduling by delay (Yang et al. 2019, §3)."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from pipejax.errors import ConfigError


def scale_hyperparams(learning_rate: float, momentum: float, batch: int,
                      new_batch: int) -> tuple[float, float]:
    """(η′, m′) for an update size `new_batch` that keep the momentum's
    half-life in samples and each sample's total contribution:

        m′ = m^(B′/B);   η′ = η·(B′/B)·(1 − m′)/(1 − m)     (Kosson et al. 2020, eq. 9)

    Pipelined backpropagation updates after every micro-batch, so a recipe
    tuned for batch B moves to micro-batch size B′ with this rule.
    """
    if batch < 1 or new_batch < 1:
        raise ConfigError(f"scale_hyperparams: batch={batch} and new_batch={new_batch} must be >= 1")
    if not 0.0 <= momentum < 1.0:
        raise ConfigError(f"scale_hyperparams: momentum={momentum} must lie in [0, 1)")
    r = new_batch / batch
    m = momentum ** r
    lr = learning_rate * r if momentum == 0.0 else learning_rate * r * (1.0 - m) / (1.0 - momentum)
    return float(lr), float(m)


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
