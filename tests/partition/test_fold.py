"""A V's split balances its devices (each holds chunks k and 2K − 1 − k),
then its chunks: checked against brute force over all splits."""

import numpy as np
import pytest

from pipejax.errors import ConfigError
from pipejax.partition import balance_folded, stage_costs
from tests.partition.test_balance import all_splits


def folded_value(costs, split, objective):
    """(the device objective, Σ C² over the chunks) of a V's split."""
    chunks = stage_costs(costs, split)
    S = len(chunks)
    devices = [chunks[k] + chunks[S - 1 - k] for k in range(S // 2)]
    device = sum(d * d for d in devices) if objective == "variance" else max(devices)
    return device, sum(c * c for c in chunks)


@pytest.mark.parametrize("objective", ["variance", "bottleneck"])
def test_folded_matches_brute_force(objective):
    rng = np.random.default_rng(1)
    for _ in range(150):
        K = int(rng.integers(1, 4))
        L = int(rng.integers(2 * K, 2 * K + 6))
        costs = rng.choice([rng.uniform(0, 10, L), rng.integers(0, 5, L).astype(float)])
        split = balance_folded(costs, K, objective)
        assert len(split) == 2 * K and sum(split) == L and min(split) >= 1
        ranked = lambda s: (round(folded_value(costs, s, objective)[0], 9),  # ties to rounding
                            folded_value(costs, s, objective)[1])
        best, got = min(map(ranked, all_splits(L, 2 * K))), ranked(split)
        assert got[0] == pytest.approx(best[0], rel=1e-9, abs=1e-12)
        assert got[1] == pytest.approx(best[1], rel=1e-9, abs=1e-12)


def test_folded_puts_a_cheap_embedding_and_head_beside_blocks():
    """The zoo GPT 6x128's layer costs (MFLOP a micro-batch): balanced as
    four stages, 2-2-2-2, device 0 would hold 2 blocks and the ends, device
    1 four blocks; folded, each device holds three."""
    costs = [0.2] + [718.5] * 6 + [102.0]
    split = balance_folded(costs, 2)
    chunks = stage_costs(costs, split)
    assert split == (3, 2, 1, 2)
    assert chunks[0] + chunks[3] == pytest.approx(3 * 718.5 + 102.2)
    assert chunks[1] + chunks[2] == pytest.approx(3 * 718.5)


def test_folded_needs_two_layers_a_device():
    with pytest.raises(ConfigError, match="shorter than intended"):
        balance_folded([1.0, 2.0, 3.0], 2)
