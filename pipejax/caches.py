"""What pipejax remembers for the life of a process, in one place: its caches.

Building a pipeline traces every layer, initializes it, works out each
stage's residuals and split backward, and reads its table's ring
capacities. All of that depends only on the layers' functions, the shapes
and the table, so a process that builds many pipelines of one model
(`pj.search`, a script comparing settings) does it once: `pj.search` over a
GPT of 4 blocks of width 32 on 4 devices, 104 candidates, took 128 s
without these memories and 27 s with them. Each memory is bounded (the
layer and stage ones hold the last 256 entries; a schedule's capacities
live as long as the schedule), and keeps each layer without the values it
arrived with (an NNX module's parameters, `Layer.without_values`), so it
holds no model alive and remembers NNX layers as it does linen ones.

`pj.clear_caches()` empties them all; `pj.cache_sizes()` says how many
entries each holds. JAX's own compiled programs are JAX's to keep:
`jax.clear_caches()` drops those.
"""

from __future__ import annotations

import collections
import operator
import weakref
from typing import Any, Callable, MutableMapping

# Each linen layer's init program, for pipelines of the same layers at any
# K, schedule or mesh and for the simulators (pipejax.layers.layer_variables).
INITS: collections.deque = collections.deque(maxlen=256)
# Each layer's analysis on its input shapes: variables, output, key use and
# FLOPs (pipejax.trace).
ANALYSES: collections.deque = collections.deque(maxlen=256)
# A stage's residuals and split backward, for its layers in one role on
# equal shapes, dtype and loss (pipejax.compile.stages).
STAGES: collections.deque = collections.deque(maxlen=256)
# A stage's optax update's temporary bytes, for one transform on equal packings
# (pipejax.compile.memory.update_bytes).
UPDATES: collections.deque = collections.deque(maxlen=256)
# The jitted generation program of equal layers and settings (pipejax.generation).
GENERATORS: collections.deque = collections.deque(maxlen=64)
# A schedule's ring capacities (pipejax.schedules.capacities).
CAPACITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

CACHES = {"layer inits": INITS, "layer analyses": ANALYSES, "stage residuals": STAGES,
            "stage updates": UPDATES, "generators": GENERATORS, "ring capacities": CAPACITIES}


def recall(memory: collections.deque | list | MutableMapping, key: Any,
           compute: Callable[[], Any], same: Callable[[Any, Any], bool] = operator.eq,
           kept: Any = None) -> Any:
    """The value `memory` holds for `key`, else `compute()`, remembered.

    A mapping (a schedule's capacities, weakly keyed) looks `key` up; a
    bounded list of (key, value) entries takes the first whose key is `same`
    as `key` (layers compare by `Layer.same`, not by hash: an NNX layer's
    values are not part of what it computes) and remembers `kept` (default
    `key`: what to hold instead, e.g. layers without their values)."""
    if isinstance(memory, MutableMapping):
        if key not in memory:
            memory[key] = compute()
        return memory[key]
    for other, value in memory:
        if same(other, key):
            return value
    value = compute()
    memory.append((key if kept is None else kept, value))
    return value


def clear_caches() -> None:
    """Forget what pipejax remembered in this process (JAX's compiled
    programs stay: `jax.clear_caches()` drops those)."""
    for memory in CACHES.values():
        memory.clear()


def cache_sizes() -> dict[str, int]:
    """How many entries each of pipejax's memories holds."""
    return {name: len(memory) for name, memory in CACHES.items()}
