"""Checkpoints that do not depend on the pipeline's layout (orbax-checkpoint).

A pipeline's buffers are packed per stage, so a checkpoint of them would be
tied to one split (DeepSpeed needs its "universal checkpointing", Megatron
resharding scripts). `save` stores what the layer list defines instead: the
variables of every layer (`pj.unstage`), each per-parameter part of the
optimizer state per layer (momentum, Adam's moments), the rest of each
stage's optimizer state (step counts), the step, the RNG key, and what only
the same layout can read back: the data rule's state and, for asynchronous
schedules, the micro-batches in flight. `restore` re-packs them for any
trainer of the same layer list: another number of stages for synchronous
schedules, or for asynchronous ones after a flush (nothing in flight).

Every array carries a leading replica axis (R pipeline replicas on a data
mesh). It restores into any number of replicas: each its own saved one
where the counts agree, else every replica from the saved replicas' mean
(`pj.unstage`'s; the same weights under SSGD). A stage sharded over F
devices saves and restores whole leaves, so any F restores it. Writing is atomic
(orbax writes a temporary directory and renames it when complete), so a save
killed midway leaves the previous checkpoint the latest one. The entries'
names, reading a checkpoint back and checking its layers are
checkpoint_files.py's.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from pipejax import checkpoint_files as files
from pipejax.checkpoint_files import latest
from pipejax.compile import (Staged, TrainState, host_array, into_pieces, state_parts,
                             unstage)
from pipejax.errors import CheckpointError
from pipejax.layers.ties import names
from pipejax.trainer import Trainer

def _layout(trainer: Trainer) -> dict:
    """What must be equal for the layout-bound parts to restore as saved."""
    plan, schedule = trainer.plan, trainer.schedule
    return {"ranges": [[r.start, r.stop] for r in plan.ranges],
            "virtual": plan.placement.virtual, "placement": plan.placement.kind,
            "schedule": schedule.name,
            "microbatches": schedule.microbatches, "replicas": trainer.replicas,
            "fsdp": trainer.build.stage.fsdp, "tensor": trainer.build.stage.tensor}


def save(path: str | os.PathLike, trainer: Trainer, state: TrainState,
         keep: int | None = None) -> int:
    """Write `state` of `trainer` as checkpoint `state.step` under directory
    `path` (replacing one of the same step); keep the last `keep` (all if
    None). Returns the step."""
    plan, R = trainer.plan, trainer.replicas
    if not isinstance(state, TrainState) or state.params.packing != trainer.packings.params:
        raise CheckpointError(f"pj.save takes the TrainState of the trainer it is given, not "
                              f"{type(state).__name__}"
                              + (" of another pipeline" if isinstance(state, TrainState) else ""))
    K = plan.stages
    replicas = [state.params.per_stage(r) for r in range(R)]
    opts = [trainer.opt_state(state, r) for r in range(R)]
    stack = lambda *xs: np.stack([np.asarray(x) for x in xs])
    tree: dict[str, Any] = {}
    for i, layer in enumerate(zip(*[unstage(state.params, replica=r) for r in range(R)])):
        tree.update(files.flat(f"layer{i}.", jax.tree.map(stack, *layer)))
    for k in range(K):
        split = [state_parts(opts[r][k], replicas[r][k]) for r in range(R)]
        is_slot = split[0][2]
        slots = [[p for p, slot in zip(flat, is_slot) if slot] for _, flat, _ in split]
        others = [[p for p, slot in zip(flat, is_slot) if not slot] for _, flat, _ in split]
        for j in range(sum(is_slot)):
            for n, i in enumerate(plan.device_layers(k)):
                tree.update(files.flat(f"opt{j}.layer{i}.", jax.tree.map(
                    stack, *[rep[j][n] for rep in slots])))
        for n, leaves in enumerate(zip(*others)):
            tree[f"stage{k}.opt.{n}"] = stack(*leaves)
    tree.update(files.flat("rule.", jax.tree.map(host_array, state.rule_state)))
    inflight = state.inflight
    flushed = True
    if inflight is not None:
        tree.update(files.flat("inflight.", jax.tree.map(host_array, inflight)))
        flushed = bool(np.asarray(inflight.start) == np.asarray(inflight.fed))
    tree["step"] = np.asarray(state.step)
    tree["key"] = np.asarray(jax.random.key_data(state.key))
    copies = _copies(trainer)  # tied weights: one copy saved, the others named
    for key in [k for k in tree if files.parameter(k)[1] in copies]:
        del tree[key]
    meta = {"format": files.FORMAT, "step": int(state.step), "stages": K, "copies": copies,
            "layers": [[s.name, files.describe(s.variables)] for s in trainer.specs],
            "key_impl": str(jax.random.key_impl(state.key)), "flushed": flushed,
            "synchronous": trainer.schedule.synchronous, "optimizer": files.kinds(opts[0][0]),
            **_layout(trainer)}
    step = int(state.step)
    manager = files.manager(path, keep)
    if step in manager.all_steps():
        manager.delete(step)
    manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(tree),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    manager.close()
    return step


def _copies(trainer: Trainer) -> dict[str, str]:
    """Each tied copy's entry name (after an 'optJ.' prefix) -> its tie's
    first holder's: 'layer3.params.embed.embedding' -> 'layer0.params.embed.embedding'."""
    entry = {}
    for i, spec in enumerate(trainer.specs):
        for path, _ in jax.tree_util.tree_flatten_with_path(spec.variables)[0]:
            entry[(i, names(path))] = f"layer{i}.{files.name(path)}"
    return {entry[h]: entry[tie.holders[0]] for tie in trainer.build.code.model.ties
            for h in tie.holders[1:]}


def restore(path: str | os.PathLike, trainer: Trainer, step: int | None = None) -> TrainState:
    """The state saved under `path` (the latest checkpoint, or `step`),
    packed for `trainer`: any number of stages for a synchronous schedule;
    for an asynchronous one the same layout, or any after a flush."""
    meta, tree = files.read(path, step)
    files.check(meta, trainer.specs)
    return _assemble(trainer, meta, tree)


def load_variables(path: str | os.PathLike, layers: Sequence[Any], example: Any,
                   step: int | None = None, replica: int | None = None) -> list:
    """The variables of every layer saved under `path` (the latest checkpoint,
    or `step`), one entry per layer as `pj.unstage` returns them, without a
    trainer: to evaluate or sample from a saved run on one device. `example`
    is an input batch of `layers` (its shape and dtype: what they were
    traced with); `replica` picks one pipeline replica of a data mesh, None
    their mean (as `pj.unstage` gives it)."""
    from pipejax.trace import trace

    specs = trace(layers, example)
    meta, tree = files.read(path, step)
    files.check(meta, specs)
    saved = meta["replicas"]
    if replica is not None and not 0 <= replica < saved:
        raise CheckpointError(f"replica {replica} of a checkpoint of {saved} replicas; use 0 to "
                              f"{saved - 1}, or None for their mean")
    pick = (lambda a: a.mean(0)) if replica is None else (lambda a: a[replica])
    return [files.entries(tree, f"layer{i}.", s.variables, pick) for i, s in enumerate(specs)]


def _assemble(trainer: Trainer, meta: dict, tree: dict[str, np.ndarray]) -> TrainState:
    """The `TrainState` of `trainer` (its plan, packings, shardings and
    abstract state) from a checkpoint's entries."""
    params_packing, opt_packing = trainer.packings
    specs, plan = trainer.specs, trainer.plan
    K, R, saved_R, F = plan.stages, trainer.replicas, meta["replicas"], trainer.build.stage.fsdp
    rep = lambda a, r: _replica(a, r, saved_R, R)
    # Older checkpoints hold one chunk per device, in a loop, on unsharded stages.
    older = {"virtual": 1, "placement": "loop", "fsdp": 1, "tensor": 1}
    same_layout = {k: meta.get(k, older.get(k)) for k in _layout(trainer)} == _layout(trainer)
    if not (same_layout or meta["flushed"]):
        raise CheckpointError(
            f"the checkpoint holds micro-batches in flight for another layout (layer ranges "
            f"{meta['ranges']}, {meta['schedule']}, M={meta['microbatches']}, {saved_R} "
            f"replicas, fsdp={meta.get('fsdp', 1)}, tensor={meta.get('tensor', 1)}); flush the "
            "trainer before saving to restore into other stages")

    leaves = lambda prefix, template, r: files.entries(tree, prefix, template, lambda a: rep(a, r))
    others = _stage_others(meta, tree, K)
    params, states = [], []
    abstract = [jax.eval_shape(t.init, params_packing.abstract_tree(k))
                for k, t in enumerate(trainer.optimizers.transforms)]  # each stage's whole state
    files.check_optimizer(meta, abstract[0])
    wholes = [state_parts(a, params_packing.abstract_tree(k)) for k, a in enumerate(abstract)]
    for r in range(R):
        for k in range(K):
            layers = [leaves(f"layer{i}.", specs[i].variables, r) for i in plan.device_layers(k)]
            treedef, flat, is_slot = wholes[k]
            values = iter(rep(a, r) for a in others(k, is_slot.count(False)))
            filled, j = [], 0
            for part, per_parameter in zip(flat, is_slot):
                if per_parameter:  # the j-th: one entry per layer of the stage
                    filled.append([leaves(f"opt{j}.layer{i}.", part[n], r)
                                   for n, i in enumerate(plan.device_layers(k))])
                    j += 1
                else:
                    filled.append(next(values))
            params.append(params_packing.pack(k, layers))
            # a row per device: a sharded stage's F pieces (compile/pieces.py)
            states += [opt_packing.pack(k, piece) for piece in
                       into_pieces(jax.tree.unflatten(treedef, filled), params_packing, k, F)]
    shardings = trainer.shardings
    stacked = lambda rows: tuple(np.stack([np.asarray(b) for b in slot]) for slot in zip(*rows))
    p = Staged(tuple(map(_put, stacked(params), shardings.params.buffers)), params_packing)
    s = Staged(tuple(map(_put, stacked(states), shardings.opt_state.buffers)), opt_packing)
    key = jax.random.wrap_key_data(_put(tree["key"], shardings.key), impl=meta["key_impl"])
    template = trainer.abstract_state(p, key)
    rule = _layout_bound("rule.", "the data rule's state", template.rule_state, tree, meta,
                         same_layout, shardings.rule_state, flushable=False)
    inflight = None
    if template.inflight is not None:
        inflight = _layout_bound("inflight.", "the micro-batches in flight", template.inflight,
                                 tree, meta, same_layout, shardings.inflight, flushable=True)
    # A synchronous table's rings hold nothing between steps: new ones, not saved.
    zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), template.scratch)
    scratch = jax.jit(zeros, out_shardings=shardings.scratch)()
    return TrainState(p, s, _put(tree["step"], shardings.step), key, inflight, rule, scratch)


def _replica(a: np.ndarray, r: int, saved: int, replicas: int) -> np.ndarray:
    """Replica r's value of a saved entry `a` (leading axis: the `saved`
    replicas) for a trainer of `replicas`: its own where the counts agree,
    the one saved replica's, else the saved replicas' mean as `pj.unstage`
    gives it, θ_0 + mean(θ_i − θ_0) (exactly θ_0 when they agree, as under
    SSGD; decentralized rules' replicas start again from their mean),
    replica 0's for integers (step counts, equal on every replica)."""
    if saved == replicas:
        return a[r]
    if saved == 1 or not np.issubdtype(a.dtype, np.floating):
        return a[0]
    return (a[0] + np.mean(a - a[0], axis=0)).astype(a.dtype)


def _put(a: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array placed with `sharding` (in a job of several processes too)."""
    return jax.make_array_from_callback(np.shape(a), sharding, lambda idx: np.asarray(a)[idx])


def _stage_others(meta: dict, tree: dict, K: int) -> Callable[[int, int], list]:
    """Stage k's optimizer leaves that are not per-parameter (step counts):
    its own when the checkpoint has as many stages, else the saved stages'
    common value (which a synchronous schedule keeps equal)."""
    saved_K = meta["stages"]
    per = [[tree[f"stage{k}.opt.{n}"] for n in range(_count(tree, k))] for k in range(saved_K)]

    def others(k: int, n: int) -> list:
        if saved_K == K:
            chosen = per[k]
        else:
            if any(len(p) != len(per[0]) or any(not np.array_equal(a, b) for a, b in zip(p, per[0]))
                   for p in per):
                raise CheckpointError(
                    f"the checkpoint's {saved_K} stages have different optimizer counters (an "
                    f"asynchronous schedule); restore it into {saved_K} stages")
            chosen = per[0]
        if len(chosen) != n:
            raise CheckpointError(f"stage {k}'s optimizer state has {n} leaves besides the "
                                  f"per-parameter ones, the checkpoint {len(chosen)}: restore "
                                  "with the optimizer it was saved with")
        return chosen

    return others


def _count(tree: dict, k: int) -> int:
    n = 0
    while f"stage{k}.opt.{n}" in tree:
        n += 1
    return n


def _layout_bound(prefix: str, what: str, template: Any, tree: dict, meta: dict,
                  same_layout: bool, sharding: Any, flushable: bool) -> Any:
    """A part only the saved layout reads (`template` of this trainer): as
    saved when the layouts and the parts agree; for the in-flight state
    (`flushable`) of a synchronous table's checkpoint (none in flight), an
    empty pipeline as a new trainer starts one, of a flushed one, an empty
    pipeline continuing the saved ids; else an error (the caller checked that
    an unflushed one has the same layout)."""
    names = list(files.flat(prefix, template))
    if not names:
        return template
    missing = [n for n in names if n not in tree]
    if same_layout and not missing:
        values = jax.tree.unflatten(jax.tree.structure(template), [tree[n] for n in names])
    elif flushable and f"{prefix}base" not in tree:  # a synchronous table's: nothing in flight
        values = jax.tree.map(lambda t: np.zeros(t.shape, t.dtype), template)
    elif flushable and meta["flushed"]:
        base = tree[f"{prefix}base"]
        values = jax.tree.map(lambda t: np.zeros(t.shape, t.dtype), template)
        values = values._replace(base=base, start=base, fed=base)
    elif missing:
        raise CheckpointError(f"the checkpoint holds {what} of another kind ({missing[0]} and "
                              f"{len(missing) - 1} more are not saved; a {meta['schedule']} "
                              f"trainer saved it): restore it into a trainer of that schedule "
                              "and data rule, or flush its micro-batches before saving")
    else:
        raise CheckpointError(f"the checkpoint holds {what} of another layout (layer ranges "
                              f"{meta['ranges']}, {meta['replicas']} replicas, fsdp="
                              f"{meta.get('fsdp', 1)}, tensor={meta.get('tensor', 1)}); restore "
                              "into the same stages, replicas, fsdp and tensor")
    return jax.tree.map(_put, values, _broadcast(sharding, values))


def _broadcast(prefix: Any, tree: Any) -> Any:
    """A sharding prefix tree expanded to `tree`'s leaves."""
    return jax.tree.map(lambda sh, sub: jax.tree.map(lambda _: sh, sub), prefix, tree,
                        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
