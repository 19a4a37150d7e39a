"""Stage k's code, as a branch of a `lax.switch` on the stage index.

Every device runs the same program (SPMD), so the per-stage functions are
branches the programs switch between, each reading its own trees out of the
shared slot buffers (heterogeneous stages in SPMD); stages of
identical structure share one branch (sharing.py). The branches are per
virtual stage j (= the stage when v = 1; with v chunks per device, the
device and local chunk the `Placement` gives): j runs its layers as f_j(params, h), the last
ending in the loss; its backward is the exact vjp of f_j at (weights,
stashed input), rebuilt from the residuals its forward kept, whole (BW) or
split into B and W (split.py). A device's parameters are one tree, its
chunks' layers in chunk order. The switch branches built from this code are
in branches.py. Re-materialization (GPipe §2): with
`remat="stage"` nothing is kept and the vjp replays the forward; with
`remat="none"` the values of its costly primitives are kept (residuals.py);
a `jax.checkpoint` policy keeps what it saves.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pipejax import caches
from pipejax.checks import Remat
from pipejax.compile import residuals
from pipejax.compile.last_stage import Backwards, deferred
from pipejax.compile.model import Feed, Model
from pipejax.compile.split import SplitBackward, split_backward
from pipejax.compile.precision import cast_floating, compute_weights
from pipejax.packing import Packing
from pipejax.compile.sharing import StageGroups
from pipejax.compile.ties import tied
from pipejax.layers import Layer, apply_layers, remembered
from pipejax.layers.sharding import tensor_axes
from pipejax.partition import Plan
from pipejax.stage_layout import StageLayout
from pipejax.trace import shapes


class StageCode:
    """The layers of each virtual stage as forward and backward branches.

    `params` packs each device's variables, `acts` the boundary activations
    (boundary j carries virtual stage j's output to j + 1), `kept` the
    residuals each virtual stage keeps from a forward to its backward, and
    with `backwards.split` (a table with W ops) `bridge` what B files for
    W, for micro-batches shaped like the model's example and targets;
    `deferred`: the last stage's backward runs its forward (last_stage.py).
    `kept` is packed whole here; over `tensor` the pipeline's build replaces
    it with the packing XLA's split asks for (`tensor.kept_packing`).
    The last stage seeds its vjp with `seed`: 1/M when a step's loss is the
    mean over M micro-batches, 1 when every micro-batch is its own update. On
    a `stage` layout of F > 1, `params` packs every slot flat, in F pieces
    (`Packing.of`), and the micro-batches are one device's part of F; with
    T > 1, the leaves the layers' annotations split over `tensor`
    (layers/sharding.py) get slots split T ways. Virtual stages of one
    structure share a branch unless `share` is false.
    """

    def __init__(self, model: Model, plan: Plan, seed: float, share: bool = True,
                 backwards: Backwards = Backwards(), stage: StageLayout = StageLayout()):
        self.model, self.plan, self.seed, self.share = model, plan, seed, share
        self.placement = placement = plan.placement
        self.S = placement.chunks
        layers = [plan.device_layers(k) for k in range(placement.stages)]
        axes = [tensor_axes(s.variables, f"layer {s.index} ({s.name})", stage.tensor)
                for s in plan.specs]
        self.params = tied(Packing.of(
            [[plan.specs[i].variables for i in ls] for ls in layers],
            order=[i for ls in layers for i in ls], fsdp=stage.fsdp,
            tensor_axes=[[a for i in ls for a in axes[i]] for ls in layers], tensor=stage.tensor),
            plan, model.ties)
        self.groups = StageGroups.by([self._structure(j) for j in range(self.S)],
                                     _same_structure, share)
        self.outputs = self._outputs()
        self.acts = Packing.of(self.outputs)
        kept = [self.residuals(j, model.remat) for j in self.groups.first]
        self.kept = Packing.of([kept[g] for g in self.groups.of])
        self.splits: list[SplitBackward] = []
        self.bridge = None
        self.deferred = deferred(backwards, kept[self.groups.of[self.S - 1]])
        if backwards.split:
            self.splits = [self._split(j) for j in self.groups.first]
            self.bridge = Packing.of([list(self.splits[g].avals) for g in self.groups.of])

    @property
    def firsts(self) -> list[int]:
        """The global index of each virtual stage's first layer."""
        return [r.start for r in self.plan.ranges]

    def residuals(self, j: int, remat: Remat) -> Any:
        """The abstract residuals virtual stage j keeps from a forward to its
        backward under `remat` (with "none": what its costly primitives made
        of one micro-batch)."""
        return self.remembered(j, ("residuals", remat), lambda: jax.eval_shape(
            lambda p, h, f: self.vjp(j, p, h, f, remat)[1],
            self.abstract_params(j), self.input_of(j), self.abstract_feed()))

    def remembered(self, j: int, kind: tuple, compute: Callable[[], Any]) -> Any:
        """`compute()` of virtual stage j, once per process for equal layers
        in the same role on equal shapes, dtype and loss (`remembered`)."""
        layers = [self.model.layers[s.index] for s in self.plan.stage_specs(j)]
        m = self.model
        kind = (*kind, j == 0, j == self.S - 1, m.compute_dtype, m.loss,
                shapes((self.abstract_params(j), self.input_of(j), m.example, m.targets)))
        return remembered(caches.STAGES, layers, kind, compute)

    def _structure(self, j: int) -> tuple:
        """What virtual stage j's code depends on: its role (reads the batch,
        ends in the loss), its layers with their input and variable shapes,
        and where its chunk sits in its device's parameter tree."""
        specs = self.plan.stage_specs(j)
        where = (self.slice_of(j), self.params.structure(self.placement.device(j)))
        return (j == 0, j == self.S - 1,
                [(self.model.layers[s.index], shapes(s.input), shapes(s.variables)) for s in specs],
                where)

    def slice_of(self, j: int) -> slice:
        """Virtual stage j's items in its device's list of layers."""
        placement, ranges = self.placement, self.plan.ranges
        before = placement.device_chunks(placement.device(j))[:placement.local(j)]
        start = sum(len(ranges[i]) for i in before)
        return slice(start, start + len(ranges[j]))

    def first_leaf(self, j: int) -> int:
        """Index of virtual stage j's first leaf among its device's leaves."""
        tree = self.params.abstract_tree(self.placement.device(j))
        return len(jax.tree.leaves(tree[:self.slice_of(j).start]))

    def abstract_params(self, j: int) -> Any:
        """Virtual stage j's parameters, abstract (a list, one entry per layer)."""
        return self.params.abstract_tree(self.placement.device(j))[self.slice_of(j)]

    def param_leaves(self, j: int) -> tuple:
        """How virtual stage j's parameter leaves are packed (`Packing`'s
        per-leaf slot, shape and tensor split), in `abstract_params` order."""
        first = self.first_leaf(j)
        n = len(jax.tree.leaves(self.abstract_params(j)))
        return self.params.leaves[self.placement.device(j)][first:first + n]

    def input_of(self, j: int) -> Any:
        """The abstract input of virtual stage j (None for the first)."""
        return self.outputs[j - 1] if j > 0 else None

    def _outputs(self) -> list:
        """What each virtual stage but the last sends on, as it computes it:
        the traced outputs, or in a compute dtype the stages' own abstract outputs."""
        if self.model.compute_dtype is None:
            return [self.plan.stage_specs(j)[-1].output for j in range(self.S - 1)]
        outputs, h = [], None
        for j in range(self.S - 1):
            h = jax.eval_shape(lambda p, h, f, j=j: self.fn(j, f, "none")(p, h),
                               self.abstract_params(j), h, self.abstract_feed())
            outputs.append(h)
        return outputs

    def abstract_feed(self) -> Feed:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return Feed(self.model.example, self.model.targets, key,
                    jax.ShapeDtypeStruct((), jnp.int32))

    def chunk_layers(self, j: int) -> Sequence[Layer]:
        """Virtual stage j's layers, in order."""
        r = self.plan.ranges[j]
        return self.model.layers[r.start:r.stop]

    def fn(self, j: int, feed: Feed, remat: Remat | None = None) -> Callable:
        """f_j(params, h): virtual stage j's layers (of global indices
        feed.first, feed.first + 1, ...: the stages of a group share this
        code); the last ends in the loss. Rematerialized as `remat` says
        (default: the pipeline's). In a compute dtype the weights and the
        batch are cast to it, and the outputs back to float32 before the loss."""
        layers = self.chunk_layers(j)
        dtype = self.model.compute_dtype

        def f(params, h):
            x = feed.x if j == 0 else h
            if dtype is not None:
                params = compute_weights(layers, params, dtype)
                x = cast_floating(x, dtype) if j == 0 else x
            out = apply_layers(layers, params, x, feed.key, True, first=feed.first)
            if j < self.S - 1:
                return out
            return self.model.loss(out if dtype is None else cast_floating(out, jnp.float32),
                                   feed.y)

        remat = self.model.remat if remat is None else remat
        if remat is jax.checkpoint_policies.everything_saveable:
            return f  # keeps what jax.vjp keeps: no checkpoint, no barrier
        policy = {"none": residuals.costly, "stage": jax.checkpoint_policies.nothing_saveable}
        return jax.checkpoint(f, policy=policy[remat] if isinstance(remat, str) else remat)

    def vjp(self, j: int, params: Any, h: Any, feed: Feed, remat: Remat | None = None):
        """Virtual stage j's output (the loss on the last), the residuals to
        keep for its backward, and how to rebuild the vjp from them.

        In a compute dtype the weights are cast before the vjp, so that the
        backward casts them again instead of keeping their cast in every
        kept slot (the zoo GPT's bf16 kept ring held each stage's weights
        per micro-batch); their gradients come back in the stored dtype, as
        the cast's own vjp hands them."""
        dtype = self.model.compute_dtype
        weights = params if dtype is None else compute_weights(self.chunk_layers(j), params, dtype)
        # only a policy that saves values rounds them (residuals.vjp); the
        # others need no second trace
        saves = (self.model.remat if remat is None else remat) not in (
            "stage", jax.checkpoint_policies.everything_saveable)
        out, vjp_fn = (residuals.vjp if saves else jax.vjp)(self.fn(j, feed, remat), weights, h)
        known = [*jax.tree.leaves((weights, h)), *jax.tree.leaves((feed.x, feed.y)), feed.key,
                 feed.first]
        kept, recipe = residuals.split(vjp_fn, known, out)
        if remat is None:  # in the program, whose kept ring was laid out outside it
            names = ", ".join(s.name for s in self.plan.stage_specs(j))
            residuals.check(kept, jax.tree.leaves(self.kept.abstract_tree(j)),
                            f"virtual stage {j} ({names})", self.model.remat)

        def rebuild(kept_again: Sequence[Any]) -> Callable:
            inner = residuals.rebuild(recipe, known, kept_again)
            if dtype is None:
                return inner

            def back(ct: Any) -> tuple:
                grads, dh = inner(ct)
                return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), dh
            return back
        return out, kept, rebuild

    def backward(self, j: int, params: Any, h: Any, feed: Feed, kept: Sequence[Any], ct: Any):
        """(param grads, input grad) of virtual stage j from its kept
        residuals; `ct` is the output's cotangent (None on the last stage,
        seeded with `seed`).

        The forward traced here only supplies the residual structure; its
        values are unused and removed by XLA (with remat, the vjp replays it).
        """
        out, _, rebuild = self.vjp(j, params, h, feed)
        return rebuild(kept)(self.seed_like(out) if ct is None else ct)

    def seed_like(self, loss: jax.Array) -> jax.Array:
        """The last stage's output cotangent: `seed` (1/M or 1)."""
        return jnp.full(loss.shape, self.seed, loss.dtype)

    def pair(self, params: Any, h: Any, feed: Feed) -> tuple:
        """(loss, parameter gradients, input gradient) of the last virtual
        stage's forward and backward of one micro-batch as one vjp
        (last_stage.py). Nothing crosses a ring, so the pair keeps what XLA
        chooses, as a plain jit does: `remat="stage"` would only replay the
        forward and "none"'s policy remakes values XLA holds anyway; a
        checkpoint policy of the user's still applies."""
        remat = self.model.remat
        if isinstance(remat, str):
            remat = jax.checkpoint_policies.everything_saveable
        loss, vjp_fn = jax.vjp(self.fn(self.S - 1, feed, remat), params, h)
        return (loss, *vjp_fn(self.seed_like(loss)))

    # ------------------------------------------------------ B/W split (split.py)
    def _split(self, j: int) -> SplitBackward:
        """Virtual stage j's backward split into B and W over the flat inputs
        (params, h, feed, kept residuals, output cotangent). W reads the
        params, the stage input, the feed and the kept residuals again from
        where they live (their rings stay until W); the bridge carries what
        only B computed, and the output cotangent. Where B runs the last
        stage's forward (`deferred`), the split is the pair's, and B also
        makes the loss, its last output."""
        args = self.backward_args(j)
        flat, tree = jax.tree.flatten(args)
        again = len(jax.tree.leaves(args[:4]))  # (params, h, feed, kept) come first
        with_loss = j == self.S - 1 and self.deferred

        def fn(*leaves):
            params, h, feed, kept, ct = jax.tree.unflatten(tree, leaves)
            if with_loss:
                loss, dparams, dh = self.pair(params, h, feed)
                return [*jax.tree.leaves((dparams, dh)), loss.astype(jnp.float32)]
            return jax.tree.leaves(self.backward(j, params, h, feed, kept, ct))

        reread = [i < again for i in range(len(flat))]
        kind = ("split", self.model.remat, self.seed, with_loss, shapes((args[3], args[4])))
        return self.remembered(j, kind, lambda: split_backward(
            fn, flat, len(jax.tree.leaves(args[0])), reread))

    def backward_args(self, j: int) -> tuple:
        """Abstract (params, h, feed, kept, ct) of virtual stage j's backward."""
        ct = None if j == self.S - 1 else self.outputs[j]
        kept = jax.tree.leaves(self.kept.abstract_tree(j))
        return (self.abstract_params(j), self.input_of(j), self.abstract_feed(), kept, ct)


def _same_structure(a: tuple, b: tuple) -> bool:
    """Whether two virtual stages' `_structure`s are equal (they share a branch)."""
    (first_a, last_a, layers_a, where_a), (first_b, last_b, layers_b, where_b) = a, b
    return (first_a == first_b and last_a == last_b and where_a == where_b
            and len(layers_a) == len(layers_b)
            and all(la.same(lb) and ia == ib and va == vb
                    for (la, ia, va), (lb, ib, vb) in zip(layers_a, layers_b)))
