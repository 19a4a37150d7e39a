"""A table's ideal step on separate devices: each op timed alone, laid on
the table as early as its inputs allow.

Each process of a job times the ops of the virtual stages its device holds
(F with the residuals it keeps, the fused backward BW, zero bubble's B and
W, the last stage's forward and backward as one vjp, and the optimizer's
update of its weights), compiled alone on its own device with concrete
inputs of the stage's shapes, called in turn with the steps they explain
(`speed.alternate`: the machine's drifts hit both alike); the fastest call
of each counts (bench/cores.py says why). `ideal_seconds` lays those times
on the table, each op as early as its inputs and its device allow, then
the slowest update. No fixed cost of a tick, no message, no ring, no lock
step: what the table would take if the executor cost nothing beyond the
arithmetic its ops do alone. A lane-count bubble is not a time: the ops
of a stage differ (B is not W, the last stage carries the head and the
loss), and this weighs each by what it takes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from pipejax.bench.speed import optimizer_step
from pipejax.compile import Feed, split_functions
from pipejax.planner.paths import earliest_path
from pipejax.schedules.tasks import Op

PAIR, UPDATE = "pair", "update"  # the last stage's one vjp; a device's optimizer update


def _concrete(tree: Any, key: jax.Array, device: jax.Device) -> Any:
    """Arrays of `tree`'s abstract shapes on `device`: small normal floats, zero integers."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))

    def make(a, k):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return 0.02 * jax.random.normal(k, a.shape, a.dtype)
        return jnp.zeros(a.shape, a.dtype)
    return jax.device_put(jax.tree.unflatten(treedef, [make(a, k) for a, k in zip(leaves, keys)]),
                          device)


def _feed(code: Any, j: int, device: jax.Device) -> Feed:
    """The micro-batch's data, key and virtual stage j's first layer, on `device`."""
    data = _concrete((code.model.example, code.model.targets), jax.random.key(300 + j), device)
    return jax.device_put(Feed(*data, jax.random.key(0), jnp.int32(code.plan.ranges[j].start)),
                          device)


def _stage_runs(code: Any, j: int, device: jax.Device) -> dict[Op | str, Callable]:
    """Virtual stage j's ops, each a call that runs it once on `device` and waits."""
    params, h, _, _, ct = code.backward_args(j)
    params = _concrete(params, jax.random.key(j), device)
    h = None if h is None else _concrete(h, jax.random.key(100 + j), device)
    feed = _feed(code, j, device)
    forward = jax.jit(lambda p, h, f: code.vjp(j, p, h, f)[:2])
    _, kept = forward(params, h, feed)
    ct = None if ct is None else _concrete(ct, jax.random.key(200 + j), device)
    backward = jax.jit(lambda p, h, f, k, c: code.backward(j, p, h, f, k, c))
    runs = {Op.F: (forward, (params, h, feed)),
            Op.BW: (backward, (params, h, feed, kept, ct))}
    if j == code.S - 1:
        runs[PAIR] = (jax.jit(code.pair), (params, h, feed))
    if code.splits:
        (b, _), (w, _) = split_functions(code, j)
        leaves = jax.tree.leaves((params, h, feed, kept, ct))
        b = jax.jit(b)
        _, bridge = b(*leaves)
        split = code.splits[code.groups.of[j]]
        runs[Op.B] = (b, tuple(leaves))
        runs[Op.W] = (jax.jit(w), ([leaves[i] for i in split.reread], bridge))
    return {op: (lambda fn=fn, args=args: jax.block_until_ready(fn(*args)))
            for op, (fn, args) in runs.items()}


def op_runs(pipe: Any, optimizer: optax.GradientTransformation) -> dict[str, Callable]:
    """Each op of each virtual stage on this process's devices, and each
    such device's optimizer update, as a call that runs it once and waits:
    `{"F/j": run}`, `"update/k"` for device k (`key`)."""
    code, placement = pipe.build.code, pipe.schedule.placement
    mine = {d.id for d in jax.local_devices()}
    devices = list(pipe.mesh.devices.flat)
    runs, held = {}, {}
    for j in range(code.S):
        device = devices[placement.device(j)]
        if device.id in mine:
            held.setdefault(placement.device(j), []).append(j)
            runs.update({key(op, j): run for op, run in _stage_runs(code, j, device).items()})
    for k, stages in held.items():
        params = _concrete([code.abstract_params(j) for j in stages], jax.random.key(k), devices[k])
        state, update = optimizer.init(params), jax.jit(optimizer_step(optimizer))
        runs[key(UPDATE, k)] = (lambda p=params, s=state: jax.block_until_ready(update(p, s, p)))
    return runs


def key(op: Op | str, index: int) -> str:
    """`op_runs`' name of an op (or the update) of virtual stage (device) `index`."""
    return f"{op.name if isinstance(op, Op) else op}/{index}"


def ideal_seconds(pipe: Any, seconds: dict[str, float],
                  path: Callable[..., float] = earliest_path) -> float:
    """The step of the table from its ops' own times (`op_runs`' fastest
    calls, of every process) laid out by `path`: `planner.paths.earliest_path`,
    each op as early as its device's order and its input allow, then the
    slowest device's update (an asynchronous table's after each backward),
    no message or tick costing anything (its `lockstep` variant: every tick
    starts when the slowest device ended the last); or
    `planner.paths.coupled_path`, each tick's collectives holding their
    receivers until their senders end the tick. The last stage's forward
    and backward in one tick (a fused pair) take the pair's time; where its
    backward runs its forward (`deferred`) the forward costs nothing and BW
    is the pair."""
    code, schedule = pipe.build.code, pipe.schedule
    last, pair = code.S - 1, seconds.get(key(PAIR, code.S - 1))
    cost = {op: [seconds.get(key(op, j), 0.0) for j in range(code.S)]
            for op in (Op.F, Op.BW, Op.B, Op.W)}
    if code.deferred:
        cost[Op.F][last], cost[Op.BW][last] = 0.0, pair
    updates = [seconds[key(UPDATE, k)] for k in range(schedule.stages)]
    return path(schedule, cost, pair, updates)
