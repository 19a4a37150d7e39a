"""Adam under delayed gradients: the base optimizer a recipe takes (SGDM,
Adam or AdamW), spike compensation on Adam's first moment, and torch's NAdam.

`AdamW(b1, b2, eps, weight_decay, mask)` is what a recipe's `optimizer=`
takes for Adam (the string "adam" is `AdamW()`, optax.adam's settings): calling it with a rate
gives `optax.adamw`'s chain, with SC_D on the first moment
(`adam_spike_compensation`) or the update direction kept for a forecast
(`update_direction`, PipeOptim) when a recipe asks. `scale_by_nadam` is
the NAdam of torch.optim.NAdam, the optimizer Ajanthan et al. 2025 run on
stashed weights.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipejax.errors import ConfigError
from pipejax.transforms.forecast import update_direction
from pipejax.transforms.muon import ON_MUON, Muon, check_muon


def _check(name: str, b1: float, b2: float, eps: float, weight_decay: float = 0.0) -> None:
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0 and eps >= 0.0 and weight_decay >= 0.0):
        raise ConfigError(f"{name}: b1={b1}, b2={b2} must lie in [0, 1), eps={eps} and "
                          f"weight_decay={weight_decay} be >= 0")


def _moments(updates, state, b1: float, b2: float, eps: float):
    """Adam's moments after `updates`, the update count t (float) and the
    denominator √(ν/(1 − β2^t)) + ε of each leaf."""
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    t = optax.safe_increment(state.count)
    tf = t.astype(jnp.float32)
    return mu, nu, t, tf, jax.tree.map(lambda v: jnp.sqrt(v / (1 - b2 ** tf)) + eps, nu)


def adam_spike_compensation(delay: float, *, b1: float = 0.9, b2: float = 0.999,
                            eps: float = 1e-8, scale: float = 1.0) -> optax.GradientTransformation:
    """Adam's scaling with spike compensation SC_D on its first moment, at update t:

        μ ← β1·μ + (1 − β1)·g;   ν ← β2·ν + (1 − β2)·g²
        update = (β1^D·μ/(1 − β1^(t+D)) + c_t·g) / (√(ν/(1 − β2^t)) + ε)
        c_t = Σ_{k<D} (1 − β1)·β1^k / (1 − β1^(t+k))

    Kosson et al. 2020's SC_D (eq. 14: v ← m·v + g, update a·v + b·g,
    a = m^D, b = Σ_{k<D} m^k) for Adam's bias-corrected average: every
    gradient's contributions move D updates earlier. The new gradient gets
    at once the weights Adam would give it over the next D updates (c_t),
    and the moment the weight it would have D updates later, so each
    gradient's total weight over time is Adam's. D = 0 is
    `optax.scale_by_adam`, D = 1 `optax.scale_by_adam(nesterov=True)`
    (Dozat 2016); `scale` gives SC_{scale·D}, a whole number of updates.
    Follow it with the weight decay and `optax.scale_by_learning_rate`, as
    `optax.adamw` does.
    """
    _check("adam_spike_compensation", b1, b2, eps)
    D = scale * delay
    if D < 0 or D != int(D):
        raise ConfigError(f"adam_spike_compensation: delay={delay} times scale={scale} must be a "
                          "whole number of updates >= 0 (Adam's catch-up sums over them)")
    ks = jnp.arange(int(D), dtype=jnp.float32)

    def update_fn(updates, state, params=None):
        del params
        mu, nu, t, tf, denominator = _moments(updates, state, b1, b2, eps)
        late = b1 ** D / (1 - b1 ** (tf + D))
        catch_up = jnp.sum((1 - b1) * b1 ** ks / (1 - b1 ** (tf + ks)))
        out = jax.tree.map(lambda m, g, d: (late * m + catch_up * g) / d, mu, updates,
                           denominator)
        return out, optax.ScaleByAdamState(count=t, mu=mu, nu=nu)

    return optax.GradientTransformation(optax.scale_by_adam(b1, b2, eps).init, update_fn)


class NAdamState(NamedTuple):
    """Adam's moments and the running product Π_t of the momentum schedule."""

    count: jax.Array  # int32: updates done
    mu: optax.Updates
    nu: optax.Updates
    mu_product: jax.Array  # float32: Π_{i ≤ t} μ_i


def scale_by_nadam(b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                   momentum_decay: float = 0.004) -> optax.GradientTransformation:
    """NAdam as torch.optim.NAdam computes it (Dozat 2016, Algorithm 2, with
    its momentum schedule), at update t:

        μ_t = β1·(1 − ½·0.96^(t·ψ));   Π_t = Π_{t−1}·μ_t
        m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²;   d = √(v/(1 − β2^t)) + ε
        update = (1 − μ_t)/(1 − Π_t)·g/d + μ_{t+1}/(1 − Π_t·μ_{t+1})·m/d

    ψ = `momentum_decay`. The optimizer of Ajanthan et al. 2025 ("Nesterov
    method for asynchronous pipeline parallel optimization", ICML, arXiv
    2505.01099; their code runs torch's NAdam, β1 = 0.99, on stashed
    weights): the look-ahead μ_{t+1}·m with the gradient's own weight
    discounted to (1 − μ_t). Follow it with the weight
    decay and `optax.scale_by_learning_rate` (torch's decoupled decay
    θ ← θ·(1 − γλ) is `optax.add_decayed_weights(λ)` before the rate).
    """
    _check("scale_by_nadam", b1, b2, eps)
    if momentum_decay < 0:
        raise ConfigError(f"scale_by_nadam: momentum_decay={momentum_decay} must be >= 0")

    def schedule(t):
        return b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))

    def init_fn(params):
        return NAdamState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params),
                          optax.tree.zeros_like(params), jnp.ones((), jnp.float32))

    def update_fn(updates, state, params=None):
        del params
        m, v, t, tf, denominator = _moments(updates, state, b1, b2, eps)
        mu_t, mu_next = schedule(tf), schedule(tf + 1)
        product = state.mu_product * mu_t
        c_g, c_m = (1 - mu_t) / (1 - product), mu_next / (1 - product * mu_next)
        out = jax.tree.map(lambda g, m, d: (c_g * g + c_m * m) / d, updates, m, denominator)
        return out, NAdamState(t, m, v, product)

    return optax.GradientTransformation(init_fn, update_fn)


class AdamW(NamedTuple):
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), as
    `optax.adamw(rate, b1, b2, eps, weight_decay=..., mask=...)`: a recipe's
    `optimizer=` for Adam with settings other than `optax.adam`'s; β1 is
    the recipe's momentum."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    mask: Any = None  # as optax.adamw's: a tree of bools or a function of the params

    def __call__(self, learning_rate: optax.ScalarOrSchedule, *, delay: float = 0.0,
                 direction: bool = False) -> optax.GradientTransformation:
        """`optax.adamw`'s chain at `learning_rate`, with SC_delay on the first
        moment (`adam_spike_compensation`) when delay > 0, and the direction
        m̂/(√v̂ + ε) kept for a forecast (`update_direction`) when asked."""
        check_optimizer(self)
        scaling = (adam_spike_compensation(delay, b1=self.b1, b2=self.b2, eps=self.eps) if delay
                   else optax.scale_by_adam(self.b1, self.b2, self.eps))
        return optax.chain(scaling, *([update_direction()] if direction else []),
                           *self._decay_and_rate(learning_rate))

    def nadam(self, learning_rate: optax.ScalarOrSchedule,
              momentum_decay: float = 0.004) -> optax.GradientTransformation:
        """torch.optim.NAdam(decoupled_weight_decay=True) at these settings
        (`scale_by_nadam`)."""
        return optax.chain(scale_by_nadam(self.b1, self.b2, self.eps, momentum_decay),
                           *self._decay_and_rate(learning_rate))

    def _decay_and_rate(self, learning_rate: optax.ScalarOrSchedule) -> tuple:
        """The end of optax.adamw's chain: decoupled decay, then the rate."""
        return (optax.add_decayed_weights(self.weight_decay, self.mask),
                optax.scale_by_learning_rate(learning_rate))


Base = str | AdamW | Muon  # a recipe's optimizer: "momentum" (SGDM), "adam" (= AdamW()),
#                           AdamW(...) or Muon(...)


def check_optimizer(optimizer: Base, recipe: str | None = None) -> None:
    """A recipe's optimizer, checked; Muon only for a `recipe` of `ON_MUON`."""
    if isinstance(optimizer, AdamW):
        _check("AdamW", optimizer.b1, optimizer.b2, optimizer.eps, optimizer.weight_decay)
    elif isinstance(optimizer, Muon):
        check_muon(optimizer)
        if recipe not in ON_MUON:
            raise ConfigError(f"{f'mitigation {recipe!r}' if recipe else 'this recipe'} on "
                              "Muon(...): its formula reads SGDM's momentum trace or Adam's "
                              f"moments, which Muon does not have; Muon runs under "
                              f"{', '.join(ON_MUON)}")
    elif optimizer not in ("momentum", "adam"):
        raise ConfigError(f"mitigation optimizer {optimizer!r}; use 'momentum', 'adam', "
                          "pj.transforms.AdamW(b1, b2, eps, weight_decay, mask) or "
                          "pj.transforms.Muon(...)")


def is_adam(optimizer: Base) -> bool:
    return isinstance(optimizer, AdamW) or optimizer == "adam"


def own_momentum(optimizer: Base) -> float | None:
    """The momentum an optimizer carries itself: Adam's β1, Muon's beta;
    None for SGDM, whose momentum a recipe is given."""
    if isinstance(optimizer, Muon):
        return optimizer.beta
    return as_adamw(optimizer).b1 if is_adam(optimizer) else None


def as_adamw(optimizer: Base) -> AdamW:
    """The AdamW of an Adam choice: "adam" is `AdamW()`, optax.adam's settings."""
    return optimizer if isinstance(optimizer, AdamW) else AdamW()


def default_form(optimizer: Base) -> str:
    """The forecast's form by default: velocity on SGDM, difference on Adam."""
    return "difference" if is_adam(optimizer) else "velocity"


def base_optimizer(optimizer: Base, rate: optax.ScalarOrSchedule, m: float,
                   delay: float = 0.0) -> optax.GradientTransformation:
    """v ← m·v + g, w ← w − η·v (SGDM), or Adam or Muon at rate η; with
    SC_delay on Adam's first moment when delay > 0."""
    if isinstance(optimizer, Muon):
        return optimizer(rate)
    if is_adam(optimizer):
        return as_adamw(optimizer)(rate, delay=delay)
    return optax.chain(optax.trace(m), optax.scale_by_learning_rate(rate))
