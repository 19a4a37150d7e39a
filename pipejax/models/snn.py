"""Self-normalizing network (Klambauer et al. 2017), the SpecTrain paper's SNN:
Dense layers with LeCun-normal initialization and SELU, optional AlphaDropout."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
from flax import nnx

from pipejax.models import nnx_modules
from pipejax.models.builder import Builder
from pipejax.models.common import alpha_dropout, flatten


class AlphaDropout(nn.Module):
    """Dropout that keeps SELU's zero mean and unit variance (Klambauer et al. 2017)."""

    rate: float
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x, deterministic: bool | None = None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return x
        return alpha_dropout(x, self.rate, self.make_rng("dropout"))


def snn(depth: int = 32, width: int = 64, classes: int = 10, dropout: float = 0.0, *,
        api: str = "linen", inputs: int | Sequence[int] | None = None,
        rngs: nnx.Rngs | None = None) -> list:
    """`depth` [Dense(LeCun normal), SELU(, AlphaDropout)] layers, then
    Dense(classes); `api="nnx"` builds NNX modules for `inputs` (models/builder.py)."""
    init = nn.initializers.lecun_normal()
    dense = lambda n: (nn.Dense(n, kernel_init=init),
                       lambda f, r: nnx.Linear(f, n, kernel_init=init, rngs=r))
    b = Builder("snn", api, inputs, rngs).add(flatten)
    for _ in range(depth):
        b.add(*dense(width)).add(nn.selu)
        if dropout > 0:
            b.add(AlphaDropout(dropout), lambda f, r: nnx_modules.AlphaDropout(dropout, rngs=r))
    return b.add(*dense(classes)).layers
