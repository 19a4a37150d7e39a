"""Timing calls against each other on a shared, noisy machine: `alternate`
calls each in turn, so that the machine's drifts hit every call alike, and
`median_seconds` is one call's median; `stepper` makes a trainer's step such
a call. The benchmarks, `trace(cost="time")` and the planner's measured
machine (`pipejax plan --search --machine host`) time with these."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np


def alternate(runs: dict[str, Callable[[], None]], repeats: int,
              deadline: float | None = None) -> dict[str, np.ndarray]:
    """Seconds of each run, called in turn `repeats` times (the machine's
    drifts hit every run alike); three warm-up rounds first. With a
    `deadline` (a `time.perf_counter()` value) the rounds stop once it has
    passed, after three at least."""
    for _ in range(3):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for i in range(repeats):
        if deadline is not None and i >= 3 and time.perf_counter() > deadline:
            break
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: np.asarray(t) for name, t in times.items()}


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of `fn()` (it blocks on its result), after three warm-up calls."""
    return float(np.median(alternate({"fn": fn}, repeats)["fn"]))


def stepper(trainer: Any, state: Any, batch: tuple) -> Callable[[], None]:
    """A call that runs one training step of `trainer` from the state the
    last one left, and waits for its loss."""
    held = [state]

    def step():
        held[0], metrics = trainer.step(held[0], batch)
        jax.block_until_ready(metrics["loss"])
    return step
