"""Self-normalizing network (Klambauer et al. 2017), the SpecTrain paper's SNN:
Dense layers with LeCun-normal initialization and SELU, optional AlphaDropout."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipejax.models.common import flatten

_ALPHA = -1.7580993408473766  # −λ·α of SELU: the value AlphaDropout drops to


class AlphaDropout(nn.Module):
    """Dropout that keeps SELU's zero mean and unit variance (Klambauer et al. 2017)."""

    rate: float
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x, deterministic: bool | None = None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        a = (keep * (1 + self.rate * _ALPHA ** 2)) ** -0.5
        b = -a * _ALPHA * self.rate
        mask = jax.random.bernoulli(self.make_rng("dropout"), keep, x.shape)
        return a * jnp.where(mask, x, _ALPHA) + b


def snn(depth: int = 32, width: int = 64, classes: int = 10, dropout: float = 0.0) -> list:
    """`depth` [Dense(LeCun normal), SELU(, AlphaDropout)] layers, then Dense(classes)."""
    init = nn.initializers.lecun_normal()
    layers: list = [flatten]
    for _ in range(depth):
        layers += [nn.Dense(width, kernel_init=init), nn.selu]
        if dropout > 0:
            layers.append(AlphaDropout(dropout))
    layers.append(nn.Dense(classes, kernel_init=init))
    return layers
