"""Ring capacities and stashes read off a table, against what the papers say."""

import pytest

from pipejax.schedules import Capacities, gpipe, in_flight, one_f_one_b, ring_capacities

GRID = [(K, M) for K in (2, 3, 4) for M in (K, 2 * K + 1)]


@pytest.mark.parametrize("K,M", GRID)
def test_gpipe_stashes_every_micro_batch(K, M):
    """GPipe runs all M forwards before the first backward (Huang et al. 2019,
    §2.2): every stage holds all M inputs and residuals, one gradient at a time,
    and one step's M micro-batches of data."""
    s = gpipe(K, M)
    assert ring_capacities(s) == Capacities(inputs=M, grads=1, residuals=M, bridge=0, data=M)
    assert [in_flight(s, k) for k in range(K)] == [M] * K


@pytest.mark.parametrize("K,M", GRID)
def test_1f1b_stage_k_stashes_K_minus_k(K, M):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021) runs K − k − 1 warm-up
    forwards on stage k, then one forward before each backward: K − k
    micro-batches in flight, at most K residual slots."""
    s = one_f_one_b(K, M)
    assert [in_flight(s, k) for k in range(K)] == [K - k for k in range(K)]
    assert ring_capacities(s).residuals == K


def test_capacities_are_computed_once_per_schedule():
    s, twin = gpipe(2, 4), gpipe(2, 4)
    assert ring_capacities(s) is ring_capacities(s)
    assert ring_capacities(twin) == ring_capacities(s)
