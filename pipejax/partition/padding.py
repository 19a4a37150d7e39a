"""Trading cost balance for padded bytes (`pj.pipeline(..., max_padding=f)`).

SPMD buffers have one shape on every device, so each packed parameter slot
is as long as the largest leaf any stage puts there (pipejax/packing.py):
a split whose stages hold very different weights pays for the largest on
every device (VGG at K = 4: 214 % padding). With `max_padding`, the
partitioner keeps its objective (variance or bottleneck) but only over
splits whose packed parameters are padded by at most that fraction of
their real bytes. The padding of a split is not a sum over stages, so the
dynamic program cannot carry it: up to `EXHAUSTIVE` splits are all tried
(exact); beyond, the program bounds each stage's parameter bytes (as with
`max_bytes`) and a binary search finds the loosest bound whose split meets
`max_padding`. No split helps a model whose largest layer holds a large
share s of the weights: every device holds it, so the padding is at least
K·s − 1 (VGG at K = 4: s = 0.76, at least 204 %).
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from pipejax.errors import ConfigError
from pipejax.packing import Packing
from pipejax.partition.balance import balance, objective_value
from pipejax.trace import LayerSpec

EXHAUSTIVE = 20_000  # splits tried one by one; beyond, a search over a byte bound


def padding(specs: Sequence[LayerSpec], split: Sequence[int]) -> float:
    """Padded over real bytes of the packed parameters of `split`, minus one."""
    bounds = np.cumsum([0, *split])
    return Packing.of([[s.variables for s in specs[a:b]]
                       for a, b in zip(bounds[:-1], bounds[1:])]).padding()


def within_padding(specs: Sequence[LayerSpec], stages: int, objective: str,
                   max_padding: float, split: tuple[int, ...]) -> tuple[int, ...]:
    """`split` if its padding is at most `max_padding`, else the best split by
    `objective` under the loosest per-stage parameter bound that meets it."""
    if padding(specs, split) <= max_padding:
        return split
    costs = [s.cost or 0.0 for s in specs]
    L = len(specs)
    if math.comb(L - 1, stages - 1) <= EXHAUSTIVE:
        tried = [(padding(specs, c), c) for c in splits(L, stages)]
        fits = [c for pad, c in tried if pad <= max_padding]
        best = min(fits, key=lambda c: objective_value(costs, c, objective), default=None)
        least = min(tried)
    else:
        best, least = _bound_search(specs, stages, objective, max_padding, costs)
    if best is None:
        share = max(s.param_bytes for s in specs) / max(sum(s.param_bytes for s in specs), 1)
        raise ConfigError(f"no split into {stages} stages found with padding <= "
                          f"{100 * max_padding:.0f}% of the parameters (the least found: "
                          f"{100 * least[0]:.1f}%, split {list(least[1])}; the largest layer holds "
                          f"{100 * share:.0f}% of the weights and every device holds it); raise "
                          "max_padding, use fewer stages or split that layer")
    return best


def splits(L: int, stages: int):
    """Every split of L layers into `stages` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, L), stages - 1):
        bounds = (0, *cuts, L)
        yield tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def _bound_search(specs: Sequence[LayerSpec], stages: int, objective: str, max_padding: float,
                  costs: list[float]) -> tuple:
    """(the best split found under a per-stage byte bound meeting
    `max_padding` or None, the least padded split tried as (padding, split))."""
    params = np.asarray([s.param_bytes for s in specs], np.float64)
    prefix = np.concatenate([[0.0], np.cumsum(params)])
    L = len(specs)
    bounds = sorted({prefix[b] - prefix[a] for a in range(L) for b in range(a + 1, L + 1)
                     if prefix[b] - prefix[a] >= params.max()})
    best, least = None, (np.inf, None)
    lo, hi = 0, len(bounds) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            candidate = balance(costs, stages, objective, bounds[mid], memory=params)
        except ConfigError:  # no split keeps every stage this small
            lo = mid + 1
            continue
        pad = padding(specs, candidate)
        least = min(least, (pad, candidate), key=lambda t: t[0])
        if pad <= max_padding:
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best, least
