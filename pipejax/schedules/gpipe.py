"""GPipe's fill-drain schedule (Huang et al. 2019, §2.2, Fig. 2c).

All M forwards flow through the K stages, then all backwards flow back;
gradients are accumulated and applied once, so the result equals
un-pipelined training on the whole mini-batch. Bubble (K−1)/(M+K−1).
"""

from __future__ import annotations

import numpy as np

from pipejax.errors import ConfigError
from pipejax.schedules.schedule import BWD, FWD, Schedule


def gpipe(K: int, M: int) -> Schedule:
    """Fill-drain table: F(k, m) at tick m + k; B(k, m) at tick (M+K−1) + (K−1−k) + m."""
    if K < 1 or M < 1:
        raise ConfigError(f"gpipe needs K >= 1 stages and M >= 1 micro-batches, got K={K}, M={M}")
    ticks = 2 * (M + K - 1)
    ops = np.zeros((ticks, K), np.int32)
    mb = np.zeros((ticks, K), np.int32)
    for k in range(K):
        for m in range(M):
            ops[m + k, k], mb[m + k, k] = FWD, m
            t = (M + K - 1) + (K - 1 - k) + m
            ops[t, k], mb[t, k] = BWD, m
    return Schedule("gpipe", ops, mb, microbatches=M, synchronous=True)
