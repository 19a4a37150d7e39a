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
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pipejax.compile.staged import StagedParams, TrainState
from pipejax.partition import Plan
from pipejax.schedules import BWD, FWD, Schedule
from pipejax.errors import BatchError
from pipejax.mesh import AXIS
from pipejax.packing import Buffers, Packing
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


class Executor:
    """Compiles (plan, schedule, loss, remat) into shard_map programs on `mesh`."""

    def __init__(self, layers: Sequence[Any], plan: Plan, schedule: Schedule, loss: Callable,
                 remat: Remat, mesh: Mesh, example: Any):
        self.layers, self.plan, self.schedule = list(layers), plan, schedule
        self.example = example
        self.loss, self.remat, self.mesh = loss, remat, mesh
        self.K, self.M = plan.stages, schedule.microbatches
        K = self.K
        self.params = plan.param_packing
        # Boundary k carries stage k's output to stage k + 1.
        self.acts = Packing.of([plan.stage_specs(k)[-1].output for k in range(K - 1)])
        self.caps = (schedule.input_capacity, schedule.grad_capacity, schedule.residual_capacity)
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
        whose loss is seeded with 1/M: the pipeline's loss is the mean).

        The forward traced here only supplies the residual structure; its
        values are unused and removed by XLA (with remat, the vjp replays it).
        """
        out, _, rebuild = self._vjp(k, params, h, x_m, y_m, key)
        ct = jnp.full(out.shape, 1.0 / self.M, out.dtype) if ct is None else ct
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

    def _pipeline_body(self, p: Buffers, x: Any, y: Any, key: jax.Array):
        """Inside shard_map: run the whole table; return (summed loss, local grads)."""
        K = self.K
        cin, cg, cr = self.caps
        k = lax.axis_index(AXIS)
        p = tuple(b[0] for b in p)
        struct = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
        kept_pack = self.kept_packing(jax.tree.map(struct, x), jax.tree.map(struct, y))
        forwards = self._forward_branches(kept_pack)
        backwards = self._backward_branches(kept_pack)
        table = (jnp.asarray(self.schedule.ops), jnp.asarray(self.schedule.mb))

        def slot(bufs, i):
            return tuple(b[i] for b in bufs)

        def put(bufs, i, value, valid):
            return tuple(b.at[i].set(jnp.where(valid, v, b[i])) for b, v in zip(bufs, value))

        def tick(carry, row):
            stash, gbuf, kept, acc, loss = carry
            op, m = row[0][k], row[1][k]
            x_m = jax.tree.map(lambda a: a[m], x)
            y_m = jax.tree.map(lambda a: a[m], y)
            key_m = jax.random.fold_in(key, m)
            # Read the slots into values of their own before any buffer is
            # written, so that XLA updates the ring buffers in place.
            h, g = lax.optimization_barrier((slot(stash, m % cin), slot(gbuf, m % cg)))

            def forward(args, c):
                kept, _, _ = c
                msg, new_kept, l = lax.switch(k, forwards, *args)
                return tuple(b.at[m % cr].set(v) for b, v in zip(kept, new_kept)), msg, l

            kept, msg_f, l = _run_if(op == FWD, forward, (p, h, x_m, y_m, key_m),
                                     (kept, self.acts.zeros(), jnp.zeros((), jnp.float32)))

            def backward(args, c):
                acc, _ = c
                grads, msg = lax.switch(k, backwards, *args)
                return tuple(a + d for a, d in zip(acc, grads)), msg

            acc, msg_b = _run_if(op == BWD, backward, (p, h, g, slot(kept, m % cr), x_m, y_m, key_m),
                                 (acc, self.acts.zeros()))
            if K > 1:
                fwd_perm = [(i, i + 1) for i in range(K - 1)]
                bwd_perm = [(i + 1, i) for i in range(K - 1)]
                sent_f = (msg_f, m, (op == FWD) & (k < K - 1))
                sent_b = (msg_b, m, (op == BWD) & (k > 0))
                got_f, mf, vf = lax.ppermute(sent_f, AXIS, fwd_perm)
                got_b, mb, vb = lax.ppermute(sent_b, AXIS, bwd_perm)
                stash = put(stash, mf % cin, got_f, vf)
                gbuf = put(gbuf, mb % cg, got_b, vb)
            return (stash, gbuf, kept, acc, loss + l), None

        carry = (self.acts.zeros((cin,)), self.acts.zeros((cg,)), kept_pack.zeros((cr,)),
                 self.params.zeros(), jnp.zeros((), jnp.float32))
        (_, _, _, acc, loss), _ = lax.scan(tick, carry, table)
        return lax.psum(loss, AXIS), acc

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

        def body(p, x, y, key):
            loss, acc = self._pipeline_body(p, x, y, key)
            return loss / self.M, tuple(b[None] for b in acc)

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
            return tuple(b[None] for b in out)

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
            p = tuple(b[0] for b in p)
            out = lax.switch(lax.axis_index(AXIS), [branch(k) for k in range(self.K)], p)
            return tuple(b[None] for b in out)

        opt_state = jax.jit(self._shard(body, (P(AXIS),), P(AXIS)))(params.buffers)
        replicated = NamedSharding(self.mesh, P())
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        # Placed as `step` returns them, so the second step does not recompile.
        return TrainState(params, opt_state, step, jax.device_put(key, replicated))

    def make_step(self, opts: Sequence[optax.GradientTransformation], opt_pack: Packing) -> Callable:
        """The jitted training step: pipeline, then each stage's update on its device."""
        pp = self.params

        def update(k):
            def run(p, g, s):
                params, grads = pp.unpack(k, p), pp.unpack(k, g)
                updates, s = opts[k].update(grads, opt_pack.unpack(k, s), params)
                return pp.pack(k, optax.apply_updates(params, updates)), opt_pack.pack(k, s)
            return run

        def body(p, s, x, y, key):
            loss, acc = self._pipeline_body(p, x, y, key)
            local = lambda bufs: tuple(b[0] for b in bufs)
            p, s = lax.switch(lax.axis_index(AXIS), [update(k) for k in range(self.K)],
                              local(p), acc, local(s))
            lead = lambda bufs: tuple(b[None] for b in bufs)
            return lead(p), lead(s), loss / self.M

        sharded = self._shard(body, (P(AXIS), P(AXIS), P(), P(), P()), (P(AXIS), P(AXIS), P()))

        def step(state: TrainState, batch: tuple):
            x, y = self._split_batch(batch)
            key = jax.random.fold_in(state.key, state.step)
            p, s, loss = sharded(state.params.buffers, state.opt_state, x, y, key)
            new = TrainState(StagedParams(p, pp), s, state.step + 1, state.key)
            return new, {"loss": loss}

        return jax.jit(step)
