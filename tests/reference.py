"""Independent references the tests compare the pipeline against."""

from __future__ import annotations

import functools
import zlib
from typing import Any, NamedTuple

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj


def heterogeneous_layers() -> list:
    """Dense, activations, a Conv over a 1-D signal with reshape/flatten,
    LayerNorm, Dropout and a Dense of another width: every stage boundary of
    a split of this list has its own shape. The same layer objects each time,
    so that the references compiled for them are reused across tests."""
    return list(_heterogeneous())


@functools.cache
def _heterogeneous() -> tuple:
    return (
        nn.Dense(32), nn.relu,
        lambda x: x.reshape(x.shape[0], 16, 2),
        nn.Conv(4, (3,)), jnp.tanh,
        lambda x: x.reshape(x.shape[0], -1),
        nn.LayerNorm(), nn.Dense(48), nn.gelu,
        nn.Dropout(0.25),
        nn.Dense(24), nn.relu,
        nn.Dense(10),
    )


def nnx_heterogeneous_layers() -> list:
    """`heterogeneous_layers` written in Flax NNX: Linear, activations, a Conv
    over a 1-D signal with reshape/flatten, LayerNorm, Dropout (its own
    random stream) and Linear layers of other widths. The same module objects
    each time (never write into them: build your own for `into=`)."""
    return list(_nnx_heterogeneous())


@functools.cache
def _nnx_heterogeneous() -> tuple:
    r = nnx.Rngs(params=0, dropout=1)
    return (
        nnx.Linear(20, 32, rngs=r), nnx.relu,
        lambda x: x.reshape(x.shape[0], 16, 2),
        nnx.Conv(2, 4, (3,), rngs=r), jnp.tanh,
        lambda x: x.reshape(x.shape[0], -1),
        nnx.LayerNorm(64, rngs=r), nnx.Linear(64, 48, rngs=r), nnx.gelu,
        nnx.Dropout(0.25, rngs=r),
        nnx.Linear(48, 24, rngs=r), nnx.relu,
        nnx.Linear(24, 10, rngs=r),
    )


def nnx_sequential_loss(modules, params, x, y, M, key, loss=pj.losses.cross_entropy):
    """The NNX model run layer after layer on one device, written with Flax's
    own API and not pipejax's: module i is `nnx.merge`d with `params[i]` (an
    nnx.State; {} for a function) and, on micro-batch m, its random streams
    reseeded with fold_in(fold_in(fold_in(key, m), i), crc32(stream name)),
    the keys pipejax documents. The mean over the M micro-batch losses."""
    parts = [nnx.split(m, nnx.Param, ...) if isinstance(m, nnx.Module) else None
             for m in modules]
    split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
    total = jnp.zeros(())
    for m, (xm, ym) in enumerate(zip(split(x), split(y))):
        h = xm
        for i, (module, part) in enumerate(zip(modules, parts)):
            if part is None:
                h = module(h)
                continue
            graphdef, _, rest = part
            layer = nnx.merge(graphdef, params[i], rest, copy=True)
            streams = {v.tag for _, v in nnx.to_flat_state(nnx.state(layer, nnx.RngKey))}
            layer_key = jax.random.fold_in(jax.random.fold_in(key, m), i)
            if streams:
                nnx.reseed(layer, policy="match_shape", **{s: jax.random.fold_in(
                    layer_key, zlib.crc32(s.encode()) & 0x7FFFFFFF) for s in streams})
            h = layer(h)
        total = total + loss(h, ym)
    return total / M


def nnx_sequential_value_and_grad(modules, M, loss=pj.losses.cross_entropy):
    """jit(value_and_grad(nnx_sequential_loss)) of (params, x, y, key), compiled
    once per (module objects, M, loss) in a test process."""
    key = ("nnx", tuple(map(id, modules)), M, loss)
    if key not in _COMPILED:
        _COMPILED[key] = (list(modules), jax.jit(jax.value_and_grad(
            lambda p, x, y, k: nnx_sequential_loss(modules, p, x, y, M, k, loss))))
    return _COMPILED[key][1]


def sequential_loss(layers, variables, x, y, M, key, loss=pj.losses.cross_entropy):
    """Mean over M micro-batches of the micro-batch loss, run layer after layer
    on one device; micro-batch m uses fold_in(key, m), layer i fold_in(., i)."""
    split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])

    def one(total, m_xy):
        m, xm, ym = m_xy
        out = pj.apply_layers(layers, variables, xm, jax.random.fold_in(key, m))
        return total + loss(out, ym), None

    cut = lambda tree: jax.tree.map(split, tree)
    total, _ = jax.lax.scan(one, jnp.zeros(()), (jnp.arange(M), cut(x), cut(y)))
    return total / M


def sequential_value_and_grad(layers, M, loss=pj.losses.cross_entropy):
    """jit(value_and_grad(sequential_loss)) as a function of (variables, x, y,
    key); one compiled function per (layer objects, M, loss) in a test process."""
    key = (tuple(map(id, layers)), M, loss)
    if key not in _COMPILED:
        _COMPILED[key] = (list(layers), jax.jit(jax.value_and_grad(
            lambda v, x, y, k: sequential_loss(layers, v, x, y, M, k, loss))))
    return _COMPILED[key][1]


_COMPILED: dict = {}  # keeps the layers alive, so their ids are not reused


def assert_equals_sequential(pipe: pj.Pipeline, features: int = 20) -> None:
    """`pipe` (built on `heterogeneous_layers`) gives the sequential model's
    loss and gradients to 1e-5 for one batch of its M micro-batches."""
    M, mb = pipe.schedule.microbatches, pipe.build.code.model.example.shape[0]
    params = pipe.init(jax.random.key(1))
    x, y = batch(M * mb, features)
    assert_pipelines_exactly(pipe, heterogeneous_layers(), params, (x, y))


def assert_pipelines_exactly(pipe: pj.Pipeline, layers: list, params: pj.Staged, batch: tuple,
                             loss=pj.losses.cross_entropy, key=None) -> None:
    """`pipe.value_and_grad` of one batch equals the sequential model's loss
    and gradients (`layers` run in sequence) to 1e-5."""
    key = jax.random.key(2) if key is None else key
    value, grads = pipe.value_and_grad(params, batch, key)
    ref_value, ref_grads = sequential_value_and_grad(layers, pipe.M, loss)(
        pj.unstage(params), *batch, key)
    assert rel_err(value, ref_value) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def rel_err(a, b) -> float:
    """Largest per-leaf max|a − b| / max|b| over two pytrees of equal structure.

    A leaf whose reference is zero in exact arithmetic (the gradient of an
    attention key bias: softmax ignores a shift shared by all keys) holds only
    rounding noise of the terms that cancel, which are as large as the other
    gradients. Its denominator is therefore floored at 1e-2 of the largest
    reference leaf: a bound of 1e-5 then never asks for less than float32's
    epsilon (1.2e-7) times the gradients' scale. Measured: such a leaf of
    |ref| ~ 2e-9 differs by 5e-9 when the largest gradient is 0.3.
    """
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la, "trees differ in size or are empty"
    scale = max(float(np.max(np.abs(np.asarray(q)))) for q in lb)
    return max(float(np.max(np.abs(np.asarray(p) - np.asarray(q))) /
                     max(float(np.max(np.abs(np.asarray(q)))), 1e-2 * scale, 1e-30))
               for p, q in zip(la, lb))


def transformed(transform: optax.GradientTransformation, updates: list) -> list:
    """What `transform` makes of each of `updates` in turn, from zero weights."""
    params = jax.tree.map(jnp.zeros_like, updates[0])
    state, out = transform.init(params), []
    for u in updates:
        v, state = transform.update(u, state, params)
        out.append(v)
    return out


def batch(n: int, features: int = 20, classes: int = 10, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(kx, (n, features), jnp.float32),
            jax.random.randint(ky, (n,), 0, classes))


def hand_forecast(versions, states, v, T, form, lr):
    """Stage weights predicted T updates ahead of version v, written out:
    difference form w_v + T·(w_v − w_{v−1}); velocity form w_v − η·T·trace_v,
    with η = lr(v − 1), the rate of the update that made version v, when lr
    is a schedule."""
    w = versions[v]
    if T == 0:
        return w
    if form == "difference":
        prev = versions[v - 1] if v > 0 else w
        return jax.tree.map(lambda a, b: a + T * (a - b), w, prev)
    (_, trace), = optax.tree.get_all_with_path(states[v], "trace")
    eta = lr(max(v - 1, 0)) if callable(lr) else lr
    return jax.tree.map(lambda a, t: a - eta * T * t, w, trace)


def versioned_reference(layers, loss, ranges, delays, variables, opt, xs, ys, key, stash,
                        predict=None):
    """Asynchronous training written as a plain loop over micro-batches that
    keeps every weight version of every stage: micro-batch i's forward on
    stage k uses the version after i − D_k updates; its backward the current
    version (i updates), or with `stash` the forward's; each backward applies
    the gradient of micro-batch i's mean loss at once. `opt` is one optax
    transform or one per stage; `predict[k]` = (T_forward, T_backward, form,
    lr) makes stage k run on `hand_forecast`s of those versions. Returns the
    weights of all layers after the last update, and each micro-batch's loss
    (computed at its forward on the last stage)."""
    K = len(ranges)
    opts = [opt] * K if isinstance(opt, optax.GradientTransformation) else list(opt)
    predict = predict or [(0, 0, "difference", None)] * K
    versions = [[[variables[i] for i in r]] for r in ranges]
    states = [[opts[k].init(versions[k][0])] for k in range(K)]

    def stage_fn(k, key_i, y):
        r = ranges[k]

        def f(w, h):
            out = pj.apply_layers(layers[r.start:r.stop], w, h, key_i, first=r.start)
            return loss(out, y) if k == K - 1 else out
        return f

    forward = [jax.jit(lambda w, h, key_i, y, k=k: stage_fn(k, key_i, y)(w, h)) for k in range(K)]

    @functools.partial(jax.jit, static_argnums=0)
    def backward(k, w, h, key_i, y, ct, state, current):
        out, vjp = jax.vjp(stage_fn(k, key_i, y), w, h)
        grads, ct = vjp(jnp.ones_like(out) if ct is None else ct)
        updates, state = opts[k].update(grads, state, current)
        return ct, state, optax.apply_updates(current, updates)

    losses = []
    for i in range(len(xs)):
        key_i = jax.random.fold_in(key, i)
        h, inputs, forward_weights = xs[i], [], []
        for k in range(K):
            T_f, _, form, lr = predict[k]
            w = hand_forecast(versions[k], states[k], max(0, i - delays[k]), T_f, form, lr)
            inputs.append(h)
            forward_weights.append(w)
            h = forward[k](w, h, key_i, ys[i])
        losses.append(float(h))
        ct = None
        for k in reversed(range(K)):
            assert len(versions[k]) == i + 1  # backwards reach a stage in micro-batch order
            _, T_b, form, lr = predict[k]
            w = forward_weights[k] if stash else hand_forecast(versions[k], states[k], i, T_b,
                                                               form, lr)
            ct, state, new = backward(k, w, inputs[k], key_i, ys[i], ct, states[k][-1],
                                      versions[k][-1])
            versions[k].append(new)
            states[k].append(state)
    return [w for k in range(K) for w in versions[k][-1]], np.asarray(losses)


def fill_microbatches(schedule: pj.Schedule) -> int:
    """Micro-batches fed before the first round trip ends (stage 0 runs the
    backward of micro-batch 0): the fill; from then on every stage is busy."""
    full = int(schedule.timeline(1).B[0, 0])
    return -(-(full + 1) // schedule.ticks) * schedule.microbatches


class AsyncRun(NamedTuple):
    pipe: Any
    state: Any
    losses: np.ndarray  # per micro-batch id, from the trainer's metrics
    ref: list  # the versioned reference's final weights, per layer
    ref_losses: np.ndarray
    params: Any  # the initial Staged parameters
    xs: jax.Array  # the micro-batches fed, [n, MB, 20]
    ys: jax.Array


def train_async(schedule, K, M, stash, opt=None, remat="stage", ref_opt=None, predict=None,
                MB=2, layers=None, R=1) -> AsyncRun:
    """Steps past the fill by 2K + M micro-batches and more, then a flush, on
    `layers` (default `heterogeneous_layers`) of 20 features; the reference
    runs `ref_opt` (default `opt`) and the hand forecasts `predict`. With R
    replicas (SSGD) the reference's micro-batch m joins every replica's m-th."""
    layers = layers or heterogeneous_layers()
    opt = opt or optax.sgd(0.05, momentum=0.9)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule, weight_stashing=stash,
                       remat=remat, mesh=pj.make_mesh(K, R))
    steps = -(-(fill_microbatches(pipe.schedule) + 2 * K + M) // M)
    params = pipe.init(jax.random.key(1))
    trainer = pipe.trainer(opt)
    state = trainer.init(params, jax.random.key(9))
    xs, ys, losses = [], [], {}

    def record(metrics):
        for g, loss in zip(np.asarray(metrics["microbatch"]), np.asarray(metrics["losses"])):
            if not np.isnan(loss):
                assert g not in losses, f"micro-batch {g} finished twice"
                losses[int(g)] = float(loss)

    for s in range(steps):
        x, y = batch(R * M * MB, seed=s)
        xs += list(x.reshape(R, M, MB, 20).transpose(1, 0, 2, 3).reshape(M, R * MB, 20))
        ys += list(y.reshape(R, M, MB).transpose(1, 0, 2).reshape(M, R * MB))
        state, metrics = trainer.step(state, (x, y))
        record(metrics)
    state, metrics = trainer.flush(state)
    record(metrics)
    assert sorted(losses) == list(range(steps * M))  # every micro-batch came out once
    ref, ref_losses = versioned_reference(layers, pj.losses.cross_entropy, pipe.plan.ranges,
                                          pipe.schedule.delays, pj.unstage(params),
                                          ref_opt or opt, xs, ys, jax.random.key(9), stash,
                                          predict)
    return AsyncRun(pipe, state, np.array([losses[g] for g in range(steps * M)]), ref, ref_losses,
                    params, jnp.stack(xs), jnp.stack(ys))
