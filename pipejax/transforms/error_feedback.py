"""Error feedback for a delayed update: the update computed now belonged to
an earlier step, which applied an older one; the difference, that step's
error, is added now.

Under PipeDream-2BW a stage's gradient at step t is that of W(t − 1)
(Narayanan et al. 2021, §3.1), so the update u_t an optimizer makes of it is
the one synchronous training would have applied at step t − 1, where u_{t−1}
went instead. Error feedback (Seide et al. 2014; Karimireddy et al. 2019,
Alg. 2) carries an applied update's error into the next one:

    W(t + 1) = W(t) + u_t + λ·(u_t − u_{t−1})

λ = 1 is error feedback for a delay of one update: written with u_{t−1} the
update of the gradient at W(t − 1), W(t + 1) = W(t) + 2·u_{t−1} − u_{t−2}.
Zmushko et al. 2026 (arXiv 2606.30634) correct 2BW's delay with an
error-feedback-inspired rule that, like this one, acts on the update
whatever the optimizer made it of. With a delay of D updates (PipeDream's
stages), λ = D extrapolates the update D steps, as `lwp` extrapolates the
weights.

Why λ = 1, and what it costs, on f(w) = h·w²/2 under SGD (u = −η·h·w, a
delay of one, ε = η·h; `tests/transforms/test_error_feedback.py`): the slow
mode decays by ε + (1 − λ)·ε² + O(ε³) a step against synchronous ε, so λ = 1
is synchronous to second order (at ε = 0.1: 0.0988 corrected, 0.1127 not,
0.1 synchronous). The stable range shrinks: ε < 1 uncorrected, < 0.62 at
λ = 1, < 2 synchronous. The correction repairs a rate the delay leaves
stable; it cannot give back one the delay forbids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.errors import ConfigError
from pipejax.transforms.adam import Base, base_optimizer, check_optimizer
from pipejax.transforms.recipes import Mitigation, rate_and_momentum

if TYPE_CHECKING:
    from pipejax.schedules.schedule import StageInfo


class ErrorFeedbackState(NamedTuple):
    """The last update the optimizer made (before the feedback) and the
    number of updates so far."""

    previous: optax.Updates
    count: jax.Array


def error_feedback(strength: float = 1.0) -> optax.GradientTransformation:
    """Error feedback on an optimizer's updates, at the end of its chain:

        update = u_t + λ·(u_t − u_{t−1})      (module docstring)

    The first update passes unchanged (no earlier step made an error).
    Optimizer-agnostic: `optax.chain(optax.adamw(η), error_feedback())`,
    `optax.chain(optax.contrib.muon(η), error_feedback())`.

    Args:
      strength: λ >= 0; 1 for a one-update delay (PipeDream-2BW), D for D
        updates, 0 the optimizer alone. An array is kept as given (for
        `optax.inject_hyperparams`).
    """
    if isinstance(strength, (int, float)) and strength < 0:
        raise ConfigError(f"error_feedback: strength={strength} must be >= 0 (1 for a delay of "
                          "one update)")

    def init_fn(params):
        return ErrorFeedbackState(previous=optax.tree.zeros_like(params),
                                  count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        first = state.count == 0
        out = jax.tree.map(
            lambda u, p: u + jnp.where(first, 0, strength * (u - p)).astype(u.dtype),
            updates, state.previous)
        return out, ErrorFeedbackState(previous=updates,
                                       count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def ef(learning_rate: optax.ScalarOrSchedule | None = None, *, momentum: float | None = None,
       reference: tuple | None = None, batch: int | None = None, horizon_scale: float = 1.0,
       optimizer: Base = "momentum") -> Mitigation:
    """The base optimizer with error feedback at λ = horizon_scale·D, D the
    stage's delay (1 at every stage under 2bw):

        W ← W + u_t + λ·(u_t − u_{t−1})

    A correction for a short delay. On the byte GPT at K = 8 (1 M tokens,
    `benchmarks/async_2bw.py` and `benchmarks/async_adamw.py`) it takes half
    of the delay's part of 2BW's gap, for AdamW and for Muon (seed 0, the
    gap split from the rate's part), while at PipeDream's and PB's delays (up
    to 7 and 14 updates) it helps neither and makes PB worse (Muon 2.185
    against 1.966 without it, 3 seeds): the larger λ, the narrower the
    stable range (module docstring).

    The arguments not listed are `no_mitigation`'s.

    Args:
      horizon_scale: multiplies the stage's delay into λ.
      optimizer: "momentum" (SGDM), "adam" (optax.adam), `AdamW(...)` or
        `Muon(...)`.
    """
    check_optimizer(optimizer, "ef")
    lr, m = rate_and_momentum(learning_rate, momentum, reference, batch, optimizer)

    def make(s: StageInfo) -> optax.GradientTransformation:
        return optax.chain(base_optimizer(optimizer, lr, m),
                           error_feedback(horizon_scale * s.delay))

    return Mitigation(make, False, lr, m)
