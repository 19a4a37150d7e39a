"""Stage k's code, as a branch of a `lax.switch` on the stage index.

Every device runs the same program (SPMD), so the per-stage functions are
branches the programs switch between, each reading its own trees out of the
shared slot buffers (DESIGN.md, heterogeneous stages in SPMD); stages of
identical structure share one branch (sharing.py). Stage k runs
its layers as f_k(params, h), the last stage ending in the loss; its backward
is the exact vjp of f_k at (weights, stashed input), rebuilt from the
residuals its forward kept. Re-materialization (GPipe §2): with
`remat="stage"` nothing is kept and the vjp replays the forward; with
`remat="none"` the pruned residuals are kept; a `jax.checkpoint` policy keeps
what it saves.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from pipejax.compile import residuals
from pipejax.compile.precision import cast_floating, compute_weights
from pipejax.compile.packing import Packing
from pipejax.compile.sharing import StageGroups
from pipejax.compile.spmd import stage_index
from pipejax.nnx_layer import NnxLayer
from pipejax.partition import Plan
from pipejax.trace import Layer, apply_layers, init_layer, layer_key, same_layer, shapes

Remat = Any  # "none" | "stage" | a jax.checkpoint policy


class Model(NamedTuple):
    """What the user gave `pj.pipeline`: the layers, the loss of one
    micro-batch, the remat mode, one micro-batch of inputs and targets
    (ShapeDtypeStructs), and the dtype the stages compute in (None: as
    stored; precision.py)."""

    layers: tuple[Layer, ...]
    loss: Callable
    remat: Remat
    example: Any
    targets: Any
    compute_dtype: Any = None


class Feed(NamedTuple):
    """What an op of stage k reads besides its weights and its boundary
    input: its micro-batch's inputs (stage 0) and targets (the last stage),
    the micro-batch's dropout key, and the global index of the stage's first
    layer (the stages of a group share one branch)."""

    x: Any
    y: Any
    key: jax.Array
    first: jax.Array


class StageCode:
    """The layers of each stage as forward, backward and init branches.

    `params` packs each stage's variables, `acts` the boundary activations
    (boundary k carries stage k's output to stage k + 1), `kept` the residuals
    each stage keeps from a forward to its backward, for micro-batches shaped
    like the model's example and targets. The last stage seeds its vjp with
    `seed`: 1/M when a step's loss is the mean over M micro-batches, 1 when
    every micro-batch is its own update. Stages of one structure share a
    branch unless `share` is false (one branch per stage).
    """

    def __init__(self, model: Model, plan: Plan, seed: float, share: bool = True):
        self.model, self.plan, self.seed, self.share = model, plan, seed, share
        self.K = plan.stages
        self.groups = StageGroups.by([self._structure(k) for k in range(self.K)], _same_structure,
                                     share)
        self.params = Packing.of([[s.variables for s in plan.stage_specs(k)] for k in range(self.K)])
        self.outputs = self._outputs()
        self.acts = Packing.of(self.outputs)
        kept = [self.residuals(k, model.remat) for k in self.groups.first]
        self.kept = Packing.of([kept[g] for g in self.groups.of])

    def residuals(self, k: int, remat: Remat) -> Any:
        """The abstract residuals stage k keeps from a forward to its backward
        under `remat` (with "none": its whole working set of one micro-batch)."""
        return jax.eval_shape(lambda p, h, f: self._vjp(k, p, h, f, remat)[1],
                              self.params.abstract_tree(k), self._input(k), self._abstract_feed())

    def _structure(self, k: int) -> tuple:
        """What stage k's code depends on: its role (reads the batch, ends in
        the loss) and its layers with their input and variable shapes."""
        specs = self.plan.stage_specs(k)
        return (k == 0, k == self.K - 1,
                [(self.model.layers[s.index], shapes(s.input), shapes(s.variables)) for s in specs])

    def _first(self) -> jax.Array:
        """Inside shard_map: the global index of this stage's first layer."""
        return jnp.asarray([r.start for r in self.plan.ranges], jnp.int32)[stage_index()]

    def _input(self, k: int) -> Any:
        return self.outputs[k - 1] if k > 0 else None

    def _outputs(self) -> list:
        """What each stage but the last sends on, as it computes it: the traced
        outputs, or in a compute dtype the stages' own abstract outputs."""
        if self.model.compute_dtype is None:
            return [self.plan.stage_specs(k)[-1].output for k in range(self.K - 1)]
        outputs, h = [], None
        for k in range(self.K - 1):
            h = jax.eval_shape(lambda p, h, f, k=k: self.fn(k, f, "none")(p, h),
                               self.params.abstract_tree(k), h, self._abstract_feed())
            outputs.append(h)
        return outputs

    def _abstract_feed(self) -> Feed:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return Feed(self.model.example, self.model.targets, key,
                    jax.ShapeDtypeStruct((), jnp.int32))

    def fn(self, k: int, feed: Feed, remat: Remat | None = None) -> Callable:
        """f_k(params, h): stage k's layers (of global indices feed.first,
        feed.first + 1, ...: the stages of a group share this code); the last
        stage ends in the loss. Rematerialized as `remat` says (default: the
        pipeline's). In a compute dtype the weights and the batch are cast to
        it, and the outputs back to float32 before the loss."""
        r = self.plan.ranges[k]
        layers = self.model.layers[r.start:r.stop]
        dtype = self.model.compute_dtype

        def f(params, h):
            x = feed.x if k == 0 else h
            if dtype is not None:
                params = compute_weights(layers, params, dtype)
                x = cast_floating(x, dtype) if k == 0 else x
            out = apply_layers(layers, params, x, feed.key, True, first=feed.first)
            if k < self.K - 1:
                return out
            return self.model.loss(out if dtype is None else cast_floating(out, jnp.float32),
                                   feed.y)

        remat = self.model.remat if remat is None else remat
        if remat == "none":
            return f
        policy = jax.checkpoint_policies.nothing_saveable if remat == "stage" else remat
        return jax.checkpoint(f, policy=policy)

    def _vjp(self, k: int, params: Any, h: Any, feed: Feed, remat: Remat | None = None):
        """Stage k's output (the loss on the last stage), the residuals to keep
        for its backward, and how to rebuild the vjp from them."""
        out, vjp_fn = jax.vjp(self.fn(k, feed, remat), params, h)
        known = [*jax.tree.leaves((params, h)), *jax.tree.leaves((feed.x, feed.y)), feed.key,
                 feed.first]
        kept, recipe = residuals.split(vjp_fn, known, out)
        return out, kept, lambda kept_again: residuals.rebuild(recipe, known, kept_again)

    def backward(self, k: int, params: Any, h: Any, feed: Feed, kept: Sequence[Any], ct: Any):
        """(param grads, input grad) of stage k from its kept residuals; `ct` is
        the output's cotangent (None on the last stage, seeded with `seed`).

        The forward traced here only supplies the residual structure; its
        values are unused and removed by XLA (with remat, the vjp replays it).
        """
        out, _, rebuild = self._vjp(k, params, h, feed)
        return rebuild(kept)(self._seed(out) if ct is None else ct)

    def _seed(self, loss: jax.Array) -> jax.Array:
        """The last stage's output cotangent: `seed` (1/M or 1)."""
        return jnp.full(loss.shape, self.seed, loss.dtype)

    # ------------------------------------------------------------- branches
    def _feed(self, micro: tuple) -> Feed:
        """Inside shard_map: the `Feed` of micro-batch (x_m, y_m, key) on this stage."""
        return Feed(*micro, self._first())

    def forward_branches(self) -> list[Callable]:
        """The branch of stage k's group: (params, input slot, (x_m, y_m,
        key)) -> (message for stage k + 1, residuals to keep, loss); the last
        stage's message is empty and its loss is the micro-batch loss, the
        others' loss 0. Run them with `self.groups.switch`."""
        K, acts, pp, kept = self.K, self.acts, self.params, self.kept

        def branch(k):
            def run(p, h, micro):
                h_in = acts.unpack(k - 1, h) if k > 0 else None
                out, res, _ = self._vjp(k, pp.unpack(k, p), h_in, self._feed(micro))
                if k == K - 1:
                    return acts.zeros(), kept.pack(k, res), out.astype(jnp.float32)
                return acts.pack(k, out), kept.pack(k, res), jnp.zeros((), jnp.float32)
            return run

        return self.groups.branches(branch)

    def backward_branches(self) -> list[Callable]:
        """The branch of stage k's group: (params, input slot, gradient slot,
        kept slot, (x_m, y_m, key)) -> (packed parameter gradients, message
        for stage k − 1)."""
        K, acts, pp, kept = self.K, self.acts, self.params, self.kept

        def branch(k):
            def run(p, h, g, r, micro):
                h_in = acts.unpack(k - 1, h) if k > 0 else None
                ct = None if k == K - 1 else acts.unpack(k, g)
                res = jax.tree.leaves(kept.unpack(k, r))
                dparams, dh = self.backward(k, pp.unpack(k, p), h_in, self._feed(micro), res, ct)
                return pp.pack(k, dparams), acts.pack(k - 1, dh) if k > 0 else acts.zeros()
            return run

        return self.groups.branches(branch)

    def fused(self, p: Any, h: Any, micro: tuple) -> tuple:
        """Inside shard_map: the last stage's forward and backward of one
        micro-batch as one vjp, for a table that runs both in one tick
        (`Schedule.fused`): (loss, packed parameter gradients, message for
        stage K − 2). Nothing is kept, so `remat="stage"` would only replay
        the forward: it runs without; a checkpoint policy still applies."""
        k, acts, pp = self.K - 1, self.acts, self.params
        remat = "none" if self.model.remat == "stage" else self.model.remat
        h_in = acts.unpack(k - 1, h) if k > 0 else None
        loss, vjp_fn = jax.vjp(self.fn(k, self._feed(micro), remat), pp.unpack(k, p), h_in)
        dparams, dh = vjp_fn(self._seed(loss))
        return (loss.astype(jnp.float32), pp.pack(k, dparams),
                acts.pack(k - 1, dh) if k > 0 else acts.zeros())

    def init_branches(self) -> list[Callable]:
        """The branch of stage k's group: key -> stage k's packed initial
        variables; layer i uses fold_in(key, i), so the values do not depend on K.
        An NNX layer's slots are zeros here: its values are staged from the
        host (`Pipeline.init`), not compiled into the program as constants."""
        def branch(k):
            def run(key):
                variables, first = [], self._first()
                for i, spec in enumerate(self.plan.stage_specs(k)):
                    layer = self.model.layers[spec.index]
                    if isinstance(layer, NnxLayer):
                        variables.append(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                                      spec.variables))
                        continue
                    h = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.input)
                    variables.append(init_layer(layer, layer_key(key, first + i), h))
                return self.params.pack(k, variables)
            return run

        return self.groups.branches(branch)


def _same_structure(a: tuple, b: tuple) -> bool:
    """Whether two stages' `_structure`s are equal (their stages share a branch)."""
    (first_a, last_a, layers_a), (first_b, last_b, layers_b) = a, b
    return (first_a == first_b and last_a == last_b and len(layers_a) == len(layers_b)
            and all(same_layer(la, lb) and ia == ib and va == vb
                    for (la, ia, va), (lb, ib, vb) in zip(layers_a, layers_b)))
