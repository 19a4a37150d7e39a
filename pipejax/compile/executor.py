"""The executor: one `shard_map` program that runs any schedule table.

Every device runs the same program (SPMD). Stage k's code is branch k of a
`lax.switch` on `axis_index('stage')`; a `lax.scan` walks the table one tick
at a time, so the compiled program does not grow with the number of
micro-batches. At each tick each stage runs the op the table gives it, then
sends activations forward and gradients backward with `lax.ppermute` outside
the switch (collectives must not sit in a branch). A message carries
(payload, micro-batch, valid); the receiver files it in a ring-buffer slot
`micro-batch mod capacity`, capacities derived from the table.

Backward = exact vjp of the stage function at (weights, stashed input).
Re-materialization (GPipe §2, "re-materialization"): with `remat="stage"`
only stage inputs are kept and the forward is recomputed inside the vjp;
with `remat="none"` the vjp residuals of the forward tick are packed into a
residual ring buffer and reused at the backward tick; a `jax.checkpoint`
policy keeps what the policy saves. Residuals that are the stage's own
inputs (weights, stashed activation, micro-batch data) are never copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.compile.staged import StagedParams, TrainState
from pipejax.errors import BatchError, ConfigError
from pipejax.mesh import AXIS
from pipejax.packing import Buffers, Packing
from pipejax.partition import Plan
from pipejax.schedules import NONE, Schedule
from pipejax.trace import apply_layers, init_layer, layer_key

Remat = Any  # "none" | "stage" | a jax.checkpoint policy


@dataclasses.dataclass(frozen=True)
class _Residuals:
    """Where each vjp residual comes from at the backward tick."""

    recipe: tuple[tuple[str, Any], ...]  # ("known", j) | ("kept", i) | ("unused", aval)
    treedef: Any


def _used_leaves(leaves: Sequence[Any], treedef: Any, out: Any) -> list[bool]:
    """Which residual leaves the vjp reads (jax.vjp also carries some it never uses)."""
    struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
    jaxpr = jax.make_jaxpr(lambda ls, ct: jax.tree.unflatten(treedef, ls)(ct))(
        [struct(x) for x in leaves], jax.tree.map(struct, out)).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars[:len(leaves)]]


def _split_residuals(vjp_fn: Any, known: Sequence[Any], out: Any) -> tuple[list, _Residuals]:
    """Sort the residual leaves of `vjp_fn`: those (by identity) among `known`,
    values available again at the backward tick; those the vjp never reads;
    and the rest, which must be kept from the forward to the backward tick."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    recipe, kept = [], []
    for leaf, used in zip(leaves, _used_leaves(leaves, treedef, out)):
        j = next((j for j, x in enumerate(known) if leaf is x), None)
        if j is not None:
            recipe.append(("known", j))
        elif not used:
            recipe.append(("unused", jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))))
        else:
            recipe.append(("kept", len(kept)))
            kept.append(leaf)
    return kept, _Residuals(tuple(recipe), treedef)


def _rebuild_vjp(res: _Residuals, known: Sequence[Any], kept: Sequence[Any]) -> Callable:
    pick = {"known": lambda j: known[j], "kept": lambda i: kept[i],
            "unused": lambda aval: jnp.zeros(aval.shape, aval.dtype)}
    return jax.tree.unflatten(res.treedef, [pick[kind](arg) for kind, arg in res.recipe])


def _run_if(pred: jax.Array, fn: Callable, operands: Any, carry: Any) -> Any:
    """`fn(operands, carry)` if `pred`, else `carry`: a while loop of 0 or 1 trips.

    Not a `lax.cond`: XLA updates a loop carry (the gradient sum, the residual
    ring buffer) in place, but copies every buffer a conditional passes through
    untouched — two copies of all gradients per tick, measured. The barrier
    ties the operands to the trip counter, so that XLA cannot hoist the work
    out of the loop as loop-invariant and run it at every tick.
    """
    def body(c):
        trips, carry = c
        trips, ops = lax.optimization_barrier((trips, operands))
        return trips + 1, fn(ops, carry)

    return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body,
                          (jnp.int32(0), carry))[1]


def _local(tree: Any) -> Any:
    """Inside shard_map: drop the leading stage axis (length 1 on each device)."""
    return jax.tree.map(lambda b: b[0], tree)


def _lead(tree: Any) -> Any:
    """Inside shard_map: add the leading stage axis back for `P('stage')` outputs."""
    return jax.tree.map(lambda b: b[None], tree)


class SteppedOnce:
    """The jitted step, called so that one execution runs at a time on CPU.

    XLA's CPU client can deadlock when executions of one program with
    collectives overlap on simulated devices (seen here: a ppermute rendezvous
    waiting forever after a few hundred quick asynchronous dispatches; blocking
    on each result ran the same loop cleanly). On CPU meshes each call
    therefore waits for its result; elsewhere it dispatches asynchronously.
    `lower`, `trace` and the rest are the jitted function's own.
    """

    def __init__(self, jitted: Callable, mesh: Mesh):
        self._jitted = jitted
        self._block = all(d.platform == "cpu" for d in mesh.devices.flat)

    def __call__(self, *args, **kwargs):
        out = self._jitted(*args, **kwargs)
        if self._block:  # one execution's outputs are ready together: wait on one
            jax.block_until_ready(jax.tree.leaves(out)[-1])
        return out

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)


class Executor:
    """Compiles (plan, schedule, loss, remat) into shard_map programs on `mesh`."""

    def __init__(self, layers: Sequence[Any], plan: Plan, schedule: Schedule, loss: Callable,
                 remat: Remat, mesh: Mesh, example: Any, weight_stashing: bool = False):
        self.layers, self.plan, self.schedule = list(layers), plan, schedule
        self.example, self.weight_stashing = example, weight_stashing
        # The last stage seeds its vjp with 1/M when the step's loss is the mean
        # over M micro-batches, with 1 when each micro-batch is its own update.
        self.seed = 1.0 / schedule.microbatches if schedule.synchronous else 1.0
        self.loss, self.remat, self.mesh = loss, remat, mesh
        self.K, self.M = plan.stages, schedule.microbatches
        K = self.K
        self.params = plan.param_packing
        # Boundary k carries stage k's output to stage k + 1.
        self.acts = Packing.of([plan.stage_specs(k)[-1].output for k in range(K - 1)])
        self.caps = (schedule.input_capacity, schedule.grad_capacity, schedule.residual_capacity,
                     schedule.data_capacity)
        self.sharding = NamedSharding(mesh, P(AXIS))

    def kept_packing(self, x_m: Any, y_m: Any) -> Packing:
        """Layout of the residuals each stage keeps from forward to backward,
        for micro-batches shaped like `x_m`, `y_m` (known at trace time)."""
        key = jax.eval_shape(lambda: jax.random.key(0))
        return Packing.of([
            jax.eval_shape(lambda p, a, x, y, kk, k=k: self._forward(k, p, a, x, y, kk)[1],
                           self.params.abstract_tree(k),
                           self._abstract_input(k), x_m, y_m, key)
            for k in range(self.K)])

    # ----------------------------------------------------------------- stages
    def _abstract_input(self, k: int) -> Any:
        return self.plan.stage_specs(k)[0].input if k > 0 else None

    def _stage_fn(self, k: int, x_m: Any, y_m: Any, key: jax.Array) -> Callable:
        """f_k(params, h): stage k's layers; the last stage ends in the loss."""
        r = self.plan.ranges[k]
        layers = self.layers[r.start:r.stop]

        def f(params, h):
            out = apply_layers(layers, params, x_m if k == 0 else h, key, True, first=r.start)
            return self.loss(out, y_m) if k == self.K - 1 else out

        if self.remat == "none":
            return f
        policy = jax.checkpoint_policies.nothing_saveable if self.remat == "stage" else self.remat
        return jax.checkpoint(f, policy=policy)

    def _vjp(self, k: int, params: Any, h: Any, x_m: Any, y_m: Any, key: jax.Array):
        """Stage k's output (the loss on the last stage), the residuals to keep
        for its backward, and how to rebuild the vjp from them."""
        out, vjp_fn = jax.vjp(self._stage_fn(k, x_m, y_m, key), params, h)
        known = [*jax.tree.leaves((params, h)), *jax.tree.leaves((x_m, y_m)), key]
        kept, res = _split_residuals(vjp_fn, known, out)
        return out, kept, lambda kept_again: _rebuild_vjp(res, known, kept_again)

    def _forward(self, k: int, params: Any, h: Any, x_m: Any, y_m: Any, key: jax.Array):
        """(output, kept residuals) of stage k on one micro-batch."""
        out, kept, _ = self._vjp(k, params, h, x_m, y_m, key)
        return out, kept

    def _backward(self, k: int, params: Any, h: Any, x_m: Any, y_m: Any, key: jax.Array,
                  kept: Sequence[Any], ct: Any):
        """(param grads, input grad) of stage k: the vjp rebuilt from kept
        residuals; `ct` is the output's cotangent (None on the last stage,
        whose loss is seeded with `self.seed`).

        The forward traced here only supplies the residual structure; its
        values are unused and removed by XLA (with remat, the vjp replays it).
        """
        out, _, rebuild = self._vjp(k, params, h, x_m, y_m, key)
        ct = jnp.full(out.shape, self.seed, out.dtype) if ct is None else ct
        return rebuild(kept)(ct)

    # -------------------------------------------------------------- one tick
    def _forward_branches(self, kept_pack: Packing) -> list[Callable]:
        """Branch k runs stage k's forward: (params, input slot, x_m, y_m, key)
        -> (message for stage k + 1, residuals to keep, loss); the last
        stage's message is empty and its loss is the micro-batch loss."""
        K, acts, pp = self.K, self.acts, self.params

        def fwd(k):
            def run(p, h, x_m, y_m, key):
                h_in = acts.unpack(k - 1, h) if k > 0 else None
                out, kept = self._forward(k, pp.unpack(k, p), h_in, x_m, y_m, key)
                if k == K - 1:
                    return acts.zeros(), kept_pack.pack(k, kept), out.astype(jnp.float32)
                return acts.pack(k, out), kept_pack.pack(k, kept), jnp.zeros((), jnp.float32)
            return run

        return [fwd(k) for k in range(K)]

    def _backward_branches(self, kept_pack: Packing) -> list[Callable]:
        """Branch k runs stage k's backward: (params, input slot, gradient slot,
        kept slot, x_m, y_m, key) -> (packed parameter gradients, message for
        stage k − 1)."""
        K, acts, pp = self.K, self.acts, self.params

        def bwd(k):
            def run(p, h, g, r, x_m, y_m, key):
                h_in = acts.unpack(k - 1, h) if k > 0 else None
                kept = jax.tree.leaves(kept_pack.unpack(k, r))
                ct = None if k == K - 1 else acts.unpack(k, g)
                dparams, dh = self._backward(k, pp.unpack(k, p), h_in, x_m, y_m, key, kept, ct)
                return pp.pack(k, dparams), acts.pack(k - 1, dh) if k > 0 else acts.zeros()
            return run

        return [bwd(k) for k in range(K)]

    def _run_table(self, p: Buffers, s: Any, bufs: dict, x_ring: Any, y_ring: Any,
                   counters: tuple, key: jax.Array, kept_pack: Packing, updates: Any):
        """Inside shard_map: run one pass over the table.

        `bufs` holds the ring buffers (stage inputs, received gradients, kept
        residuals, stashed weights); `counters` = (base, start, fed): this
        pass's micro-batch ids are base + relative id, and an op is real only
        for start <= id < fed (the rest is the fill or the drain, masked).
        Synchronous tables accumulate gradients into `acc`; asynchronous ones
        call `updates` (one optax update per stage) after every backward.
        Returns (params, opt state, buffers, acc, loss sum, losses counted).
        """
        K, sync = self.K, self.schedule.synchronous
        cin, cg, cr, cd = self.caps
        k = lax.axis_index(AXIS)
        base, start, fed = counters
        forwards = self._forward_branches(kept_pack)
        backwards = self._backward_branches(kept_pack)
        table = (jnp.asarray(self.schedule.fwd, jnp.int32), jnp.asarray(self.schedule.bwd, jnp.int32))

        def slot(buf, i):
            return tuple(b[i] for b in buf)

        def put(buf, i, value, valid):
            return tuple(b.at[i].set(jnp.where(valid, v, b[i])) for b, v in zip(buf, value))

        def tick(carry, row):
            p, s, bufs, acc, loss, count = carry
            rel_f, rel_b = row[0][k], row[1][k]
            gf, gb = base + rel_f, base + rel_b
            do_f = (rel_f != NONE) & (gf >= start) & (gf < fed)
            do_b = (rel_b != NONE) & (gb >= start) & (gb < fed)
            data = lambda ring, g: jax.tree.map(lambda a: a[g % cd], ring)
            # Read the slots into values of their own before any buffer is
            # written, so that XLA updates the ring buffers in place.
            h_f, h_b, g_b = lax.optimization_barrier(
                (slot(bufs["stash"], gf % cin), slot(bufs["stash"], gb % cin),
                 slot(bufs["grads"], gb % cg)))
            args_f = (h_f, data(x_ring, gf), data(y_ring, gf), jax.random.fold_in(key, gf))

            def forward(args, c):
                p, kept, wstash, _, loss, count = c
                msg, new_kept, l = lax.switch(k, forwards, p, *args)
                kept = tuple(b.at[gf % cr].set(v) for b, v in zip(kept, new_kept))
                wstash = tuple(b.at[gf % cr].set(v) for b, v in zip(wstash, p))
                return p, kept, wstash, msg, loss + l, count + (k == K - 1)

            _, kept, wstash, msg_f, loss, count = _run_if(
                do_f, forward, args_f,
                (p, bufs["kept"], bufs["weights"], self.acts.zeros(), loss, count))
            r = slot(kept, gb % cr)
            p_b = slot(wstash, gb % cr) if self.weight_stashing else p
            args_b = (h_b, g_b, r, data(x_ring, gb), data(y_ring, gb), jax.random.fold_in(key, gb))

            def backward(args, c):
                p, s, acc, _ = c
                p_b, *rest = args
                grads, msg = lax.switch(k, backwards, p_b, *rest)
                if sync:
                    return p, s, tuple(a + d for a, d in zip(acc, grads)), msg
                p, s = lax.switch(k, updates, p, grads, s)
                return p, s, acc, msg

            p, s, acc, msg_b = _run_if(do_b, backward, (p_b, *args_b),
                                       (p, s, acc, self.acts.zeros()))
            bufs = dict(bufs, kept=kept, weights=wstash)
            if K > 1:
                fwd_perm = [(i, i + 1) for i in range(K - 1)]
                bwd_perm = [(i + 1, i) for i in range(K - 1)]
                got_f, mf, vf = lax.ppermute((msg_f, gf, do_f & (k < K - 1)), AXIS, fwd_perm)
                got_b, mb, vb = lax.ppermute((msg_b, gb, do_b & (k > 0)), AXIS, bwd_perm)
                bufs["stash"] = put(bufs["stash"], mf % cin, got_f, vf)
                bufs["grads"] = put(bufs["grads"], mb % cg, got_b, vb)
            return (p, s, bufs, acc, loss, count), None

        acc = self.params.zeros() if sync else ()
        zero = jnp.zeros((), jnp.float32)
        (p, s, bufs, acc, loss, count), _ = lax.scan(
            tick, (p, s, bufs, acc, zero, jnp.zeros((), jnp.int32)), table)
        return p, s, bufs, acc, lax.psum(loss, AXIS), lax.psum(count, AXIS)

    def ring_buffers(self, kept_pack: Packing, lead: tuple[int, ...] = ()) -> dict:
        """Zero ring buffers of one device (`lead` = (K,) for all devices)."""
        cin, cg, cr, _ = self.caps
        return {"stash": self.acts.zeros((*lead, cin)), "grads": self.acts.zeros((*lead, cg)),
                "kept": kept_pack.zeros((*lead, cr)),
                "weights": self.params.zeros((*lead, cr)) if self.weight_stashing else ()}

    def _kept_for(self, x: Any, y: Any) -> Packing:
        """The residual layout for data rings / batches shaped [n, mb, ...]."""
        struct = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
        return self.kept_packing(jax.tree.map(struct, x), jax.tree.map(struct, y))

    def _sync_pass(self, p: Buffers, x: Any, y: Any, key: jax.Array):
        """A synchronous table over one batch [M, mb, ...]: (acc grads, loss sum, count)."""
        kept_pack = self._kept_for(x, y)
        counters = (jnp.int32(0), jnp.int32(0), jnp.int32(self.M))
        _, _, _, acc, loss, count = self._run_table(
            p, (), self.ring_buffers(kept_pack), x, y, counters, key, kept_pack, None)
        return acc, loss, count

    # ------------------------------------------------------------ programs
    def _shard(self, fn: Callable, in_specs, out_specs) -> Callable:
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _split_batch(self, batch: tuple) -> tuple:
        """[M·mb, ...] -> [M, mb, ...], after checking the batch against the
        example micro-batch (at trace time: shapes are static)."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise BatchError("a batch is a pair (x, y) of inputs and targets")
        x, y = batch
        M = self.M
        n = jnp.shape(jax.tree.leaves(x)[0])[0]
        if n % M:
            raise BatchError(f"batch of {n} examples does not split into microbatches={M} "
                             f"({n} % {M} = {n % M}); use a batch size divisible by {M}")
        for a, e in zip(jax.tree.leaves(x), jax.tree.leaves(self.example)):
            if (n // M, *jnp.shape(a)[1:]) != tuple(jnp.shape(e)):
                raise BatchError(
                    f"inputs of shape {list(jnp.shape(a))} split into {M} micro-batches of "
                    f"{[n // M, *jnp.shape(a)[1:]]}, but the pipeline was traced with example "
                    f"{list(jnp.shape(e))}; give x of shape {[M * jnp.shape(e)[0], *jnp.shape(e)[1:]]}")
        for a in jax.tree.leaves(y):
            if jnp.shape(a)[0] != n:
                raise BatchError(f"targets hold {jnp.shape(a)[0]} examples but inputs hold {n}; "
                                 "give one target per example")
        split = lambda a: a.reshape(M, a.shape[0] // M, *a.shape[1:])
        return jax.tree.map(split, x), jax.tree.map(split, y)

    def value_and_grad(self, params: StagedParams, batch: tuple, key: jax.Array):
        """Mean loss over the M micro-batches and its gradient, stage-sharded."""
        x, y = self._split_batch(batch)

        if self.schedule.asynchronous:
            raise ConfigError(f"value_and_grad needs a synchronous schedule; {self.schedule.name!r} "
                              "updates the weights inside the pipeline: use pipe.step")

        def body(p, x, y, key):
            acc, loss, count = self._sync_pass(_local(p), x, y, key)
            return loss / count, _lead(acc)

        loss, grads = self._shard(body, (P(AXIS), P(), P(), P()), (P(), P(AXIS)))(
            params.buffers, x, y, key)
        return loss, StagedParams(grads, self.params)

    def init_params(self, key: jax.Array) -> StagedParams:
        """Each stage initializes its own layers on its own device; layer i
        uses fold_in(key, i), so the values do not depend on K."""
        plan = self.plan

        def branch(k):
            def run(key):
                variables = []
                for spec in plan.stage_specs(k):
                    h = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.input)
                    variables.append(init_layer(self.layers[spec.index], layer_key(key, spec.index), h))
                return self.params.pack(k, variables)
            return run

        def body(key):
            out = lax.switch(lax.axis_index(AXIS), [branch(k) for k in range(self.K)], key)
            return _lead(out)

        buffers = jax.jit(self._shard(body, (P(),), P(AXIS)))(key)
        return StagedParams(buffers, self.params)

    def stage(self, variables: Sequence[dict]) -> StagedParams:
        """Pack one variables dict per layer (as `unstage` returns) onto the stages."""
        rows = [self.params.pack(k, [variables[i] for i in self.plan.ranges[k]])
                for k in range(self.K)]
        buffers = tuple(jax.device_put(jnp.stack(slot), self.sharding) for slot in zip(*rows))
        return StagedParams(buffers, self.params)

    # ------------------------------------------------------------ training
    def optimizers(self, optimizer: Any) -> list[optax.GradientTransformation]:
        """One transform per stage: `optimizer(StageInfo)` or the same for all."""
        if isinstance(optimizer, optax.GradientTransformation):
            return [optimizer] * self.K
        if callable(optimizer):
            return [optimizer(self.schedule.stage_info(k)) for k in range(self.K)]
        raise TypeError(f"optimizer must be an optax GradientTransformation or a function "
                        f"StageInfo -> GradientTransformation, not {type(optimizer).__name__}")

    def opt_packing(self, opts: Sequence[optax.GradientTransformation]) -> Packing:
        return Packing.of([jax.eval_shape(opts[k].init, self.params.abstract_tree(k))
                           for k in range(self.K)])

    def init_state(self, params: StagedParams, opts, opt_pack: Packing, key: jax.Array) -> TrainState:
        def branch(k):
            return lambda p: opt_pack.pack(k, opts[k].init(self.params.unpack(k, p)))

        def body(p):
            p = _local(p)
            out = lax.switch(lax.axis_index(AXIS), [branch(k) for k in range(self.K)], p)
            return _lead(out)

        opt_state = jax.jit(self._shard(body, (P(AXIS),), P(AXIS)))(params.buffers)
        replicated = NamedSharding(self.mesh, P())
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        # Placed as `step` returns them, so the second step does not recompile.
        # An asynchronous pipeline's in-flight buffers are made by its first
        # step, once the shape of the targets is known.
        return TrainState(params, opt_state, step, jax.device_put(key, replicated), None)

    def _updates(self, opts: Sequence[optax.GradientTransformation], opt_pack: Packing) -> list:
        """Branch k: stage k's optax update of its packed (params, grads, state)."""
        pp = self.params

        def update(k):
            def run(p, g, s):
                params, grads = pp.unpack(k, p), pp.unpack(k, g)
                updates, s = opts[k].update(grads, opt_pack.unpack(k, s), params)
                return pp.pack(k, optax.apply_updates(params, updates)), opt_pack.pack(k, s)
            return run

        return [update(k) for k in range(self.K)]

    def make_step(self, opts: Sequence[optax.GradientTransformation], opt_pack: Packing) -> Callable:
        """The jitted training step. Synchronous: the table, then each stage's
        update on its device. Asynchronous: one period of the table, with the
        updates inside it and the in-flight micro-batches kept in the state."""
        if self.schedule.asynchronous:
            return SteppedOnce(jax.jit(functools.partial(self._async_pass, opts, opt_pack,
                                                         feed=True)), self.mesh)
        pp, updates = self.params, self._updates(opts, opt_pack)

        def body(p, s, x, y, key):
            acc, loss, count = self._sync_pass(_local(p), x, y, key)
            p, s = lax.switch(lax.axis_index(AXIS), updates, _local(p), acc, _local(s))
            return _lead(p), _lead(s), loss / count

        sharded = self._shard(body, (P(AXIS), P(AXIS), P(), P(), P()), (P(AXIS), P(AXIS), P()))

        def step(state: TrainState, batch: tuple):
            x, y = self._split_batch(batch)
            key = jax.random.fold_in(state.key, state.step)
            p, s, loss = sharded(state.params.buffers, state.opt_state, x, y, key)
            new = TrainState(StagedParams(p, pp), s, state.step + 1, state.key, None)
            return new, {"loss": loss, "completed": jnp.int32(self.M)}

        return SteppedOnce(jax.jit(step), self.mesh)

    def _async_pass(self, opts, opt_pack: Packing, state: TrainState, batch: tuple | None, *,
                    feed: bool):
        """One period of an asynchronous table. With `feed`, the batch's M
        micro-batches enter the data rings as ids base..base+M−1; without, the
        period only advances what is in flight (flush). Dropout keys are
        fold_in(state.key, id), the same at a micro-batch's forward and backward."""
        K, M, cd = self.K, self.M, self.caps[3]
        if feed:
            x, y = self._split_batch(batch)
        else:
            x, y = state.inflight["x"], state.inflight["y"]
            x, y = (jax.tree.map(lambda a: a[0, :M], t) for t in (x, y))
        kept_pack = self._kept_for(x, y)
        inflight = state.inflight
        if inflight is None:  # the first step: empty rings, nothing in flight
            ring = lambda a: jnp.zeros((K, cd, *a.shape[1:]), a.dtype)
            inflight = {"bufs": self.ring_buffers(kept_pack, (K,)), "x": jax.tree.map(ring, x),
                        "y": jax.tree.map(ring, y), "base": jnp.int32(0), "start": jnp.int32(0),
                        "fed": jnp.int32(0)}
        base, start, fed = inflight["base"], inflight["start"], inflight["fed"]
        x_ring, y_ring = inflight["x"], inflight["y"]
        if feed:
            write = lambda ring, new: lax.dynamic_update_slice_in_dim(
                ring, jnp.broadcast_to(new[None], (K, *new.shape)), base % cd, axis=1)
            x_ring, y_ring = jax.tree.map(write, x_ring, x), jax.tree.map(write, y_ring, y)
            fed = base + M
        updates = self._updates(opts, opt_pack)

        def body(p, s, bufs, x_ring, y_ring, base, start, fed, key):
            p, s, bufs, _, loss, count = self._run_table(
                _local(p), _local(s), _local(bufs), _local(x_ring), _local(y_ring), (base, start, fed),
                key, kept_pack, updates)
            return _lead(p), _lead(s), _lead(bufs), loss, count

        sharded = self._shard(body, (P(AXIS),) * 5 + (P(),) * 4,
                              (P(AXIS), P(AXIS), P(AXIS), P(), P()))
        p, s, bufs, loss, count = sharded(state.params.buffers, state.opt_state, inflight["bufs"],
                                          x_ring, y_ring, base, start, fed, state.key)
        inflight = {"bufs": bufs, "x": x_ring, "y": y_ring, "base": base + M, "start": start,
                    "fed": fed}
        new = TrainState(StagedParams(p, self.params), s, state.step + (1 if feed else 0),
                         state.key, inflight)
        return new, {"loss": loss / jnp.maximum(count, 1), "completed": count}

    def make_flush(self, opts, opt_pack: Packing) -> Callable:
        """`flush(state)`: periods with no new input until nothing is in flight;
        returns the state and the metrics of the micro-batches it completed."""
        period = SteppedOnce(jax.jit(functools.partial(self._async_pass, opts, opt_pack,
                                                       batch=None, feed=False)), self.mesh)
        tl = self.schedule.timeline(1)
        periods = -(-(int(tl.B.max()) + 1) // self.schedule.ticks) - 1  # beyond the feeding one

        def flush(state: TrainState):
            if not self.schedule.asynchronous or state.inflight is None:
                return state, {"loss": jnp.float32(0), "completed": jnp.int32(0)}
            total, count = 0.0, 0
            for _ in range(periods):
                state, m = period(state)
                total += float(m["loss"]) * int(m["completed"])
                count += int(m["completed"])
            inflight = dict(state.inflight, start=state.inflight["base"], fed=state.inflight["base"])
            return state._replace(inflight=inflight), {"loss": total / max(count, 1),
                                                       "completed": count}

        return flush
