"""The CPU dispatch guard: at most `DEPTH` pipelined programs in flight on XLA CPU.

The deadlock it prevents (root cause found with `benchmarks/cpu_deadlock.py`,
jax/jaxlib 0.10.2; a native backtrace of the hung process shows each piece):
XLA's CPU client launches each device's part of a multi-device program on a
worker pool of max(cores, devices) threads, and each part first takes a slot
of a per-device semaphore that paces the host (32 programs in flight by
default, `max_inflight_computations_per_device`), waiting for it while it
holds a pool thread. Once the host has dispatched more than 32 programs ahead,
a new program's part on device d blocks on that semaphore; the parts of an
earlier program on the other devices occupy the remaining threads in a
collective (`ppermute`, `psum`), waiting for device d's part, which cannot get
a thread; device d's slots are held by the programs queued behind it. With no
more cores than devices (2 cores and 4 or 8 simulated devices here) no thread
is spare and the cycle closes. Measured with that reproducer: up to 32
programs in flight never hung (3 × 5,000 calls), 33 or more hung within about
80 calls every time, and a program without collectives never hung.

So the guard keeps at most `DEPTH` guarded calls in flight in the whole
process (the semaphore is per device and shared by every program): before it
dispatches a call it waits for the call dispatched `DEPTH` calls earlier, on
one small output that every device writes. The host still prepares the next
batch while the devices run the current step. It applies to meshes of CPU
devices only, and to everything a jitted function gives: `lower(...)`,
`.compile()` and `trace(...)` return guarded objects too.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax.errors import ArgumentTypeError

DEPTH = 2  # calls in flight; XLA's CPU client deadlocks beyond 32
_pending: collections.deque = collections.deque()
_lock = threading.Lock()


def _witness(out: Any, devices: frozenset) -> Any:
    """The smallest output written on every device of the mesh (all outputs
    of one execution on a device are ready together), or all outputs."""
    spanning = [a for a in jax.tree.leaves(out)
                if isinstance(a, jax.Array) and a.sharding.device_set >= devices]
    # The last smallest: a metric rather than a part of a donated state.
    return min(reversed(spanning), key=lambda a: a.size) if spanning else out


def _wait(witness: Any) -> None:
    """Block on a witness; a part of it donated to a later call (a train
    state) is gone, and that call is itself waited for in its turn."""
    jax.block_until_ready([a for a in jax.tree.leaves(witness)
                           if not (isinstance(a, jax.Array) and a.is_deleted())])


def in_flight() -> int:
    """Guarded calls dispatched and not yet waited for (at most `DEPTH`)."""
    return len(_pending)


def _dispatch(fn: Callable, args: tuple, kwargs: dict, devices: frozenset) -> Any:
    with _lock:
        while len(_pending) >= DEPTH:
            _wait(_pending.popleft())
        out = fn(*args, **kwargs)
        _pending.append(_witness(out, devices))
    return out


def check_live(args: Any, name: str) -> None:
    """Raise if an argument was donated to (or deleted by) an earlier call.
    JAX 0.10's CPU client crashes the process on a donated buffer of a
    multi-device array instead of raising, so the check comes first."""
    for path, a in jax.tree_util.tree_leaves_with_path(args):
        if isinstance(a, jax.Array) and a.is_deleted():
            what = ("state" if path[0].idx == 0 else f"argument {path[0].idx}") + \
                jax.tree_util.keystr(path[1:])
            raise ArgumentTypeError(
                f"{name}: {what} was donated to an earlier call "
                "and is deleted; pass the state the last call returned (state, metrics = "
                f"{name}(state, ...)), or keep a copy made before with "
                "jax.tree.map(jnp.copy, state)")


class Guarded:
    """A jitted function (or its `Traced`, `Lowered`, `Compiled`) whose calls
    go through the guard on a CPU mesh and straight through elsewhere; with
    a `name`, its arguments are checked for donated buffers first."""

    _STAGES = ("lower", "trace", "compile")

    def __init__(self, fn: Any, devices: frozenset | None, name: str | None = None):
        self._fn, self._devices, self._name = fn, devices, name

    def __call__(self, *args, **kwargs):
        if self._name is not None:
            check_live(args, self._name)
        if self._devices is None:
            return self._fn(*args, **kwargs)
        return _dispatch(self._fn, args, kwargs, self._devices)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fn, name)
        if name in self._STAGES:
            return lambda *a, **k: Guarded(attr(*a, **k), self._devices, self._name)
        return attr

    def __repr__(self) -> str:
        return f"Guarded({self._fn!r})"


def guarded(fn: Callable, mesh: Mesh, name: str | None = None) -> Guarded:
    """`fn` (a jitted function) behind the guard when `mesh` is made of CPU
    devices; `name` (a function that donates): check its arguments first."""
    devices = frozenset(np.asarray(mesh.devices).flat)
    return Guarded(fn, devices if all(d.platform == "cpu" for d in devices) else None, name)
