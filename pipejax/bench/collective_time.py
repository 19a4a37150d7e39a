"""Where a process's step goes: its collectives against the rest, from the
profiler's trace.

XLA:CPU records every thunk it runs (a fusion, a copy, a collective) as a
trace event. A collective's event lasts from its start until its peers
have joined and its data has crossed, so on a device of its own its time
is the device idling for a peer (the bubble, a slower stage) plus the
link; the rest of the step is the device busy. A waiting gloo collective
takes no processor time (measured: a process waiting 4 s in a `psum`
used 0.01 s of its core), so that idle time is an idle core.

The profiler costs each event some microseconds, and a step runs some
ten thousand: the GPT 6x128's step took 1.4x as long traced. The share of
the traced step is what is kept; it undercounts the idle share somewhat,
as the added cost falls on the busy part.
"""

from __future__ import annotations

import gzip
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Callable

import jax

COLLECTIVE = re.compile(r"^(ppermute|psum|pmax|pmin|all-reduce|all-gather|all-to-all|"
                        r"collective-permute|reduce-scatter|send|recv)")


def collective_share(run: Callable[[], None], barrier: Callable[[], None],
                     steps: int = 3) -> float:
    """The share of `steps` calls of `run` spent in collectives, traced
    from a `barrier` that every process of the job passes together: once
    before the trace starts, once after (starting it takes each process its
    own time), so the trace's collectives hold the second wait alone."""
    with tempfile.TemporaryDirectory() as folder:
        barrier()
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        barrier()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        wall = time.perf_counter() - start
        jax.profiler.stop_trace()
        events = json.load(gzip.open(next(Path(folder).rglob("*.json.gz"))))
    events = events["traceEvents"] if isinstance(events, dict) else events
    waiting = sum(e["dur"] for e in events
                  if e.get("ph") == "X" and COLLECTIVE.match(e.get("name", ""))) / 1e6
    return min(waiting / wall, 1.0)
