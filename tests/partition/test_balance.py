"""The partitioners are exact: checked against brute force over all splits."""

import itertools

import numpy as np
import pytest

from pipejax.errors import ConfigError
from pipejax.partition import balance, check_split, objective_value, stage_costs


def all_splits(L, K):
    for cuts in itertools.combinations(range(1, L), K - 1):
        bounds = (0, *cuts, L)
        yield tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def brute_force(costs, K, objective, max_bytes=None, memory=None):
    best = None
    for split in all_splits(len(costs), K):
        if max_bytes is not None and max(stage_costs(memory, split)) > max_bytes:
            continue
        value = objective_value(costs, split, objective)
        best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("objective", ["variance", "bottleneck"])
def test_matches_brute_force_on_random_instances(objective):
    rng = np.random.default_rng(0)
    for _ in range(300):
        L = int(rng.integers(1, 11))
        K = int(rng.integers(1, L + 1))
        costs = rng.choice([rng.uniform(0, 10, L), rng.integers(0, 5, L).astype(float)])
        split = balance(costs, K, objective)
        assert len(split) == K and sum(split) == L and min(split) >= 1
        assert objective_value(costs, split, objective) == pytest.approx(
            brute_force(costs, K, objective), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("objective", ["variance", "bottleneck"])
def test_memory_limit_matches_brute_force(objective):
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(300):
        L = int(rng.integers(2, 10))
        K = int(rng.integers(1, L + 1))
        costs, memory = rng.uniform(0, 10, L), rng.uniform(1, 10, L)
        limit = float(rng.uniform(memory.max(), memory.sum()))
        expected = brute_force(costs, K, objective, limit, memory)
        if expected is None:
            with pytest.raises(ConfigError, match="max_bytes"):
                balance(costs, K, objective, max_bytes=limit, memory=memory)
            continue
        split = balance(costs, K, objective, max_bytes=limit, memory=memory)
        assert max(stage_costs(memory, split)) <= limit
        assert objective_value(costs, split, objective) == pytest.approx(expected, rel=1e-12)
        checked += 1
    assert checked > 100


def test_variance_beats_an_even_layer_count_on_skewed_costs():
    costs = [8, 1, 1, 1, 1, 1, 1, 2]
    assert balance(costs, 2, "variance") == (1, 7)
    assert balance(costs, 4, "bottleneck")[0] == 1


def test_objectives_can_disagree():
    """Bottleneck ignores everything but the largest stage; variance does not."""
    costs = [5, 1, 1, 5, 3]
    v, b = balance(costs, 3, "variance"), balance(costs, 3, "bottleneck")
    assert objective_value(costs, v, "variance") <= objective_value(costs, b, "variance")
    assert objective_value(costs, b, "bottleneck") <= objective_value(costs, v, "bottleneck")


def test_errors_name_the_numbers():
    with pytest.raises(ConfigError, match=r"shorter than intended partitions \(3 < 4\)"):
        balance([1, 2, 3], 4)
    with pytest.raises(ConfigError, match="layer 1 alone needs 9 bytes > max_bytes=5"):
        balance([1, 1, 1], 2, max_bytes=5, memory=[1, 9, 1])
    with pytest.raises(ConfigError, match="max_bytes needs `memory`"):
        balance([1, 1], 1, max_bytes=5)
    with pytest.raises(ConfigError, match="non-negative"):
        balance([1, -1], 1)


def test_check_split():
    assert check_split([2, 1], 3, 2) == (2, 1)
    with pytest.raises(ConfigError, match="has 3 stages but stages=2"):
        check_split([1, 1, 1], 3, 2)
    with pytest.raises(ConfigError, match="empty stage"):
        check_split([3, 0], 3, 2)


def test_stashed_activations_count_per_micro_batch_in_flight():
    """Stage j of layers [a, b) needs Σ memory + in_flight[j]·(inputs[a] + Σ stash):
    the split equals brute force under that memory, stage by stage."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        L = int(rng.integers(2, 9))
        K = int(rng.integers(1, L + 1))
        costs, memory = rng.uniform(0, 10, L), rng.uniform(1, 5, L)
        inputs, stash = rng.uniform(0, 3, L), rng.uniform(0, 2, L)
        flights = list(rng.integers(1, 5, K))
        need = lambda split: [memory[a:b].sum() + f * (inputs[a] + stash[a:b].sum())
                              for (a, b), f in zip(_bounds(split), flights)]
        limit = float(rng.uniform(memory.max() + 5, memory.sum() + 30))
        fitting = [s for s in all_splits(L, K) if max(need(s)) <= limit]
        if not fitting:
            with pytest.raises(ConfigError, match="max_bytes"):
                balance(costs, K, max_bytes=limit, memory=memory, inputs=inputs, stash=stash,
                        in_flight=flights)
            continue
        split = balance(costs, K, max_bytes=limit, memory=memory, inputs=inputs, stash=stash,
                        in_flight=flights)
        assert max(need(split)) <= limit
        assert objective_value(costs, split, "variance") == pytest.approx(
            min(objective_value(costs, s, "variance") for s in fitting), rel=1e-12)


def _bounds(split):
    edges = np.cumsum([0, *split])
    return list(zip(edges[:-1], edges[1:]))
