"""Shared by the benchmarks: the machine and versions, a table printer, JSON output."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pipejax import bench
from pipejax.bench import table

__all__ = ["RESULTS", "environment", "median_time", "save", "table"]

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    return bench.environment(" ".join([sys.executable.split("/")[-1], *sys.argv]))


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn()` (which must block until its result is ready)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2))
    return path
