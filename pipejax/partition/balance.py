"""Exact contiguous partitions of a layer list into K stages.

GPipe (Huang et al. 2019, §2) partitions "to minimize the variance in the
estimated costs of all cells"; with the total fixed that is minimizing
Σ_k C_k², which a dynamic program over (stage, layer) solves exactly in
O(K·L²). torchgpipe's block partition is a heuristic that "might not be
optimal"; ours is exact. PipeDream's objective, the largest stage cost
(bottleneck), is solved by the same program with max in place of sum.
An optional per-stage memory limit removes the splits that exceed it: a
stage's parameters and their optimizer copies, plus the activations it
keeps for each micro-batch in flight (the schedule says how many).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pipejax.errors import ConfigError

OBJECTIVES = ("variance", "bottleneck")


def check_split(split: Sequence[int], n_layers: int, stages: int) -> tuple[int, ...]:
    """Validate an explicit split `[n_layers_stage_0, ...]` and return it as a tuple."""
    split = tuple(int(n) for n in split)
    if len(split) != stages:
        raise ConfigError(f"partition {list(split)} has {len(split)} stages but stages={stages}; "
                          "give one layer count per stage")
    if any(n < 1 for n in split):
        raise ConfigError(f"partition {list(split)} has an empty stage; every stage needs a layer")
    if sum(split) != n_layers:
        raise ConfigError(f"partition {list(split)} covers {sum(split)} layers but the list has "
                          f"{n_layers}; the counts must add up to the number of layers")
    return split


def stage_costs(costs: Sequence[float], split: Sequence[int]) -> list[float]:
    """Sum of `costs` over each stage of `split`."""
    bounds = np.cumsum([0, *split])
    return [float(np.sum(costs[a:b])) for a, b in zip(bounds[:-1], bounds[1:])]


def objective_value(costs: Sequence[float], split: Sequence[int], objective: str) -> float:
    """Σ C_k² for "variance", max C_k for "bottleneck"."""
    c = np.asarray(stage_costs(np.asarray(costs, float), split))
    return float(np.sum(c * c)) if objective == "variance" else float(np.max(c))


def _check(costs: np.ndarray, stages: int, objective: str, max_bytes: float | None,
           memory: Sequence[float] | None) -> None:
    L = len(costs)
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown partition objective {objective!r}; use one of {OBJECTIVES} "
                          "or an explicit list of layer counts")
    if stages < 1:
        raise ConfigError(f"stages={stages}; a pipeline needs at least 1 stage")
    if stages > L:
        raise ConfigError(f"sequence is shorter than intended partitions ({L} < {stages}); "
                          "use fewer stages or more layers")
    if np.any(costs < 0) or not np.all(np.isfinite(costs)):
        raise ConfigError("layer costs must be finite and non-negative")
    if max_bytes is not None:
        if memory is None or len(memory) != L:
            raise ConfigError(f"max_bytes needs `memory`, the bytes of each of the {L} layers")
        too_big = [i for i in range(L) if memory[i] > max_bytes]
        if too_big:
            raise ConfigError(f"layer {too_big[0]} alone needs {memory[too_big[0]]:.0f} bytes > "
                              f"max_bytes={max_bytes:.0f}; raise the limit")


def balance(costs: Sequence[float], stages: int, objective: str = "variance",
            max_bytes: float | None = None, memory: Sequence[float] | None = None,
            inputs: Sequence[float] | None = None, stash: Sequence[float] | None = None,
            in_flight: Sequence[int] | None = None) -> tuple[int, ...]:
    """The optimal contiguous split of `costs` into `stages` non-empty stages.

    Args:
      costs: one cost per layer (FLOPs, seconds, ...), non-negative.
      stages: K, the number of stages.
      objective: "variance" minimizes Σ_k C_k² (GPipe §2); "bottleneck"
        minimizes max_k C_k (PipeDream).
      max_bytes: optional limit on the memory of every stage.
      memory: bytes of each layer, required with `max_bytes`.
      inputs, stash, in_flight: optional per-micro-batch bytes of each
        layer's input (kept when the layer starts a stage) and of what each
        layer keeps for its backward, and how many micro-batches each stage
        holds at once: stage j of layers [a, b) needs Σ memory[a:b] +
        in_flight[j]·(inputs[a] + Σ stash[a:b]).

    Returns:
      The number of layers in each stage, e.g. (3, 2, 3).
    """
    costs = np.asarray(costs, dtype=np.float64)
    L = len(costs)
    _check(costs, stages, objective, max_bytes, memory)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    if max_bytes is not None:
        mem_prefix = np.concatenate([[0.0], np.cumsum(np.asarray(memory, np.float64))])
        held = np.concatenate([[0.0], np.cumsum(np.zeros(L) if stash is None else stash)])
        first = np.zeros(L) if inputs is None else np.asarray(inputs, np.float64)
        flights = [0] * stages if in_flight is None else list(in_flight)

    def fits(j: int, a: int, b: int) -> bool:
        """Whether layers [a, b) fit stage j - 1 under `max_bytes`."""
        if max_bytes is None:
            return True
        kept = first[a] + held[b] - held[a]
        return mem_prefix[b] - mem_prefix[a] + flights[j - 1] * kept <= max_bytes

    def stage_value(a: int, b: int) -> float:
        c = prefix[b] - prefix[a]
        return c * c if objective == "variance" else c

    combine = (lambda x, y: x + y) if objective == "variance" else max
    # best[j, i]: optimal value of the first i layers in j stages; arg: where stage j starts.
    best = np.full((stages + 1, L + 1), np.inf)
    arg = np.zeros((stages + 1, L + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, L - (stages - j) + 1):
            for s in range(j - 1, i):
                if best[j - 1, s] == np.inf or not fits(j, s, i):
                    continue
                value = combine(best[j - 1, s], stage_value(s, i))
                if value < best[j, i]:
                    best[j, i], arg[j, i] = value, s
    if best[stages, L] == np.inf:
        raise ConfigError(f"no split of {L} layers into {stages} stages keeps every stage under "
                          f"max_bytes={max_bytes:.0f}; raise the limit or use more stages")
    split, i = [], L
    for j in range(stages, 0, -1):
        s = int(arg[j, i])
        split.append(i - s)
        i = s
    return tuple(reversed(split))
