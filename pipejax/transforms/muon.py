"""Muon as a recipe's base optimizer: `optax.contrib.muon` with the settings
a recipe and the CLI name, as `AdamW` is Adam's.

Muon (Jordan et al. 2024) orthogonalizes each matrix's Nesterov momentum by
Newton–Schulz iterations; the leaves it does not take (embeddings, biases,
norms, any leaf `dimensions` leaves None) run Adam. With `consistent_rms`
an update's RMS is matched to AdamW's (0.2; Liu et al. 2025, "Muon is
Scalable for LLM Training", §2.2), so AdamW's rates and decay carry over:
the staleness studies run it so (benchmarks/async_adamw.py). Its momentum is
`beta`, as Adam's is β1; it runs under the recipes that apply the
optimizer's own update (`ON_MUON`), not under those whose formula reads
SGDM's momentum trace or Adam's moments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

from pipejax.errors import ConfigError


ON_MUON = ("none", "stash", "ef")  # the recipes (by name) that run on Muon


class Muon(NamedTuple):
    """`optax.contrib.muon(rate, beta, weight_decay, weight_decay_mask=mask,
    adam_b2=adam_b2, consistent_rms=..., muon_weight_dimension_numbers=
    dimensions)`. `dimensions`: a tree or a function of the params giving
    each matrix's `MuonDimensionNumbers` (None: every 2-D leaf, optax's
    default; the zoo GPT's: `pj.models.gpt_muon_dimensions`)."""

    beta: float = 0.95
    weight_decay: float = 0.0
    mask: Any = None  # as optax's weight_decay_mask: a tree of bools or a function of the params
    dimensions: Any = None
    adam_b2: float = 0.95
    consistent_rms: float | None = 0.2

    def __call__(self, learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformation:
        check_muon(self)
        return optax.contrib.muon(learning_rate, beta=self.beta, weight_decay=self.weight_decay,
                                  weight_decay_mask=self.mask, adam_b2=self.adam_b2,
                                  consistent_rms=self.consistent_rms,
                                  muon_weight_dimension_numbers=self.dimensions)


def check_muon(muon: Muon) -> None:
    """Raise unless Muon's momenta lie in [0, 1) and its decay is >= 0."""
    if not (0.0 <= muon.beta < 1.0 and 0.0 <= muon.adam_b2 < 1.0 and muon.weight_decay >= 0.0):
        raise ConfigError(f"Muon: beta={muon.beta} and adam_b2={muon.adam_b2} must lie in "
                          f"[0, 1), weight_decay={muon.weight_decay} be >= 0")
