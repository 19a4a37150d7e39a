"""Balancing the devices of a V: both ends of the model on one device.

A V of K devices and 2K chunks (placement.py: ZB-V, DualPipeV) puts
chunks k and 2K − 1 − k on device k, so device 0 holds the first and the
last chunk, where a model's embedding and head sit. What runs in
parallel is devices, not chunks, and a device's work per micro-batch is
its two chunks together: D_k = C_k + C_{2K−1−k}. Balancing the 2K chunks
as stages (GPipe's Σ_j C_j²) leaves the ends light and both on device 0:
the zoo GPT 6x128 at K = 2 split 2-2-2-2 gave device 0 the embedding, 2
blocks and the head (1539 MFLOP a micro-batch) and device 1 4 blocks
(2874), and ZB-V's step on 2 pinned cores followed device 1. So the V
is folded: GPipe's objective over the devices, Σ_k D_k² ("variance") or
max_k D_k ("bottleneck"), and among the splits that tie, Σ_j C_j² over
the chunks, whose imbalance the V's dependencies still feel. Folded
(3-1-2-2), the ideal step of ZB-V and of DualPipeV at remat "none", M = 8
(their ops timed alone, laid on the table), went from 1.20× 1F1B's to
0.91× and 0.87× (`python benchmarks/cores.py --models gpt`, `ideal_ms`).

Folded, device k's chunks are nested intervals: k covers [i_k, i_{k+1})
on the way down and [j_{k+1}, j_k) on the way up, inside device k − 1's.
A dynamic program from the outside in over (k, i_k, j_k) is exact in
O(K·L⁴), vectorized over the ends inside: 0.2 s for 50 layers at K = 8,
3 s for 100.

A loop (device k holds chunks k, k + K, ...) needs none of this: each
round of K chunks is contiguous, one per device, so balanced chunks are
balanced devices up to a layer; a V of more than two chunks a device
zigzags and is balanced as stages.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pipejax.partition.balance import _check


def balance_folded(costs: Sequence[float], devices: int, objective: str = "variance"
                   ) -> tuple[int, ...]:
    """The optimal contiguous split of `costs` into the 2K chunks of a V
    over K = `devices`: the layer counts in chunk order, e.g. (2, 2, 1, 3);
    `objective` as `balance`'s."""
    c = np.asarray(costs, dtype=np.float64)
    _check(c, 2 * devices, objective, None, None)
    P = np.concatenate([[0.0], np.cumsum(c)])
    if objective == "variance":  # both sums: one pass ranks (Σ D², Σ C²) exactly
        return _folded(P, devices, lambda d: d * d, np.add)
    # max D is not a sum: find the least bottleneck, then the best chunks under it.
    worst = _folded(P, devices, lambda d: d, np.maximum, value_only=True)
    return _folded(P, devices, np.zeros_like, np.add, limit=worst * (1 + 1e-12))


def _folded(P: np.ndarray, K: int, value: Callable[[np.ndarray], np.ndarray],
            combine: Callable[[np.ndarray, np.ndarray], np.ndarray], limit: float = np.inf,
            value_only: bool = False) -> tuple[int, ...] | float:
    """The dynamic program from the outside in: per device the pair
    (`value`(D) combined over devices by `combine`, Σ C² summed), ranked in
    that order, each device's load D at most `limit`. Returns the split, or
    with `value_only` the least combined value."""
    L = len(P) - 1
    idx = np.arange(L + 1)
    # Innermost device K − 1 takes [i, j) whole, split at m into its two chunks.
    f_p = np.full((L + 1, L + 1), np.inf)
    f_s = np.full((L + 1, L + 1), np.inf)
    inner_m = np.zeros((L + 1, L + 1), np.int64)
    for i in range(L + 1):
        for j in range(i + 2, L + 1):
            if P[j] - P[i] > limit:
                continue
            m = np.arange(i + 1, j)
            s = (P[m] - P[i]) ** 2 + (P[j] - P[m]) ** 2
            f_p[i, j], f_s[i, j], inner_m[i, j] = value(P[j] - P[i]), s.min(), m[s.argmin()]
    # After device k: f[i, j] is devices k … K − 1 over layers [i, j);
    # args[k][i, j] device k's inner ends (i', j').
    args = []
    for _ in range(K - 1):
        best_p = np.full((L + 1, L + 1), np.inf)
        best_s = np.full((L + 1, L + 1), np.inf)
        arg = np.zeros((L + 1, L + 1, 2), np.int64)
        for i in range(L - 1):
            r = idx[i + 1:]  # device k's inner ends i' (rows), j' (columns) past i
            j = idx[i + 2:, None, None]  # every outer end at once: [j, i', j']
            down, up = P[r][:, None] - P[i], P[j] - P[r][None, :]
            ok = (r[:, None] <= r[None, :]) & (r[None, :] < j) & (down + up <= limit)
            p = np.where(ok, combine(value(down + up), f_p[i + 1:, i + 1:]), np.inf)
            p_min = p.min(axis=(1, 2), keepdims=True)
            tie = np.isclose(p, p_min, rtol=1e-12, atol=0.0) & np.isfinite(p)
            s = np.where(tie, down ** 2 + up ** 2 + f_s[i + 1:, i + 1:], np.inf).reshape(len(j), -1)
            flat, rows = s.argmin(axis=1), np.arange(len(j))
            best_p[i, i + 2:] = p.reshape(len(j), -1)[rows, flat]
            best_s[i, i + 2:] = s[rows, flat]
            arg[i, i + 2:] = i + 1 + np.stack(np.unravel_index(flat, (len(r), len(r))), axis=1)
        args.append(arg)
        f_p, f_s = best_p, best_s
    if value_only:
        return float(f_p[0, L])
    down, up, i, j = [], [], 0, L
    for arg in reversed(args):  # device 0 first
        i2, j2 = (int(x) for x in arg[i, j])
        down.append(i2 - i)
        up.append(j - j2)
        i, j = i2, j2
    m = int(inner_m[i, j])
    return tuple(down + [m - i, j - m] + up[::-1])
