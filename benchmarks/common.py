"""Shared by the benchmarks: the machine and versions, a table printer, JSON
output, and markdown tables for the documentation (which renders them from
the JSON when the site builds)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from pipejax import bench
from pipejax.bench import table
from pipejax.formatting import in_words

__all__ = ["RESULTS", "in_words", "in_workers", "environment", "load", "markdown", "median_time",
           "save", "signed", "table"]

RESULTS = Path(__file__).parent / "results"


def environment() -> dict:
    return bench.environment(" ".join([sys.executable.split("/")[-1], *sys.argv]))


def in_workers(fn: Callable, jobs: list, workers: int) -> list:
    """`[fn(job) for job in jobs]` in `workers` spawned processes, sharing JAX's
    persistent compilation cache (a temporary directory): programs that only
    differ in what their state holds (`mitigation(sweep=True)`) compile once.
    Each worker runs XLA's CPU kernels on one thread: there is a worker per
    core, and for the small ops of a micro-batch-1 run Eigen's thread pool
    costs more than it gives (a fine-ResNet update at K = 8 in `pj.simulate`,
    one process alone: 0.47–0.53 ms on one thread, 0.73–0.84 ms with the pool;
    beside a second worker the two were within this machine's noise)."""
    import concurrent.futures
    import multiprocessing
    import os
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="pipejax-jax-cache-")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                      XLA_FLAGS=f"{flags} --xla_cpu_multi_thread_eigen=false")
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            return list(pool.map(fn, jobs))
    finally:
        os.environ["XLA_FLAGS"] = flags
        shutil.rmtree(cache, ignore_errors=True)


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


def load(name: str) -> dict:
    """What `save(name, ...)` wrote."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def signed(value: float, spec: str) -> str:
    """`value` formatted with a sign and a typographic minus: +1.6e-05, −0.9."""
    text = f"{value:+{spec}}"
    return "−" + text[1:] if text.startswith("-") else text


def markdown(rows: list[dict]) -> str:
    """Rows as a markdown table, a column a key of any row."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: "–" if v is None else str(v)
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys),
                      *("| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows)])


def _ranks(a: list[float]) -> np.ndarray:
    """Ranks of `a`, ties at their mean rank (rounded JSON figures tie)."""
    a = np.asarray(a, float)
    order = np.argsort(a, kind="stable")
    ranks = np.empty(len(a))
    ranks[order] = np.arange(len(a))
    for value in np.unique(a):
        ranks[a == value] = ranks[a == value].mean()
    return ranks


def agreement(predicted: list[float], measured: list[float]) -> dict:
    """Spearman's rank correlation and the mean and largest relative error."""
    errors = [100 * abs(p / m - 1) for p, m in zip(predicted, measured)]
    return {"spearman": round(float(np.corrcoef(_ranks(predicted), _ranks(measured))[0, 1]), 3),
            "mean |error| %": round(float(np.mean(errors)), 1),
            "max |error| %": round(max(errors), 1)}
