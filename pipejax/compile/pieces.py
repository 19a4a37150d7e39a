"""A sharded stage's optimizer state, whole from its F pieces and back.

On a stage sharded over F devices (compile/fsdp.py) each device's optax
state is the state of its piece of every leaf (`Packing.shard`), kept in a
row of its own (`[R·K·F, ...]`). `whole` joins the F states into the one
the optimizer would hold over the whole leaves (what `trainer.opt_state`
returns and a checkpoint stores: the same as at F = 1), `into_pieces` cuts a
whole state into the F pieces' states (what a checkpoint restores into).
A part of the state shaped like the stage's parameters (momentum, Adam's
moments) is cut as the parameters are; any other leaf (a step count) is
the same on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pipejax.compile.state import Staged, host_array
from pipejax.errors import ArgumentTypeError, ConfigError
from pipejax.packing import Packing


def state_parts(state: Any, params: Any) -> tuple[Any, list, list[bool]]:
    """A stage's optax state as (treedef, its parts, which parts are shaped
    like the stage's parameters: the per-parameter states; the others are leaves)."""
    like = jax.tree.structure(params)
    is_part = lambda x: jax.tree.structure(x) == like
    flat, treedef = jax.tree.flatten(state, is_leaf=is_part)
    return treedef, flat, [is_part(p) for p in flat]


def tensor_axes(state: Any, params: Packing, k: int) -> list:
    """The axis each leaf of stage k's optax `state` splits over `tensor`:
    a per-parameter part's leaves as the parameters they follow, the others
    (step counts) none."""
    tree = params.abstract_tree(k)
    _, flat, per_parameter = state_parts(state, tree)
    axes = [s.tensor_axis for s in params.leaves[k]]
    return [a for part, cut in zip(flat, per_parameter)
            for a in (axes if cut else [None] * len(jax.tree.leaves(part)))]


def check(init: Any, params: Packing, k: int, F: int) -> None:
    """Raise unless the optax state `init` makes over stage k's pieces is
    the pieces of the state it makes over the whole leaves: per-parameter
    parts shaped like the leaves they follow, other leaves alike."""
    tree, pieces = params.abstract_tree(k), params.shard(F).abstract_tree(k)
    (wdef, whole, wflags), (pdef, piece, pflags) = (
        state_parts(jax.eval_shape(init, t), t) for t in (tree, pieces))
    like = lambda part, t: [a.shape for a in jax.tree.leaves(part)] == [
        a.shape for a in jax.tree.leaves(t)]
    ok = wdef == pdef and wflags == pflags and all(
        like(w, tree) and like(p, pieces) if cut else np.shape(w) == np.shape(p)
        for w, p, cut in zip(whole, piece, wflags))
    if not ok:
        raise ConfigError(
            f"stage {k}'s optimizer keeps state not shaped like the parameters it updates "
            f"(Adafactor's factored moments, say): on a stage sharded over fsdp={F} devices each "
            "device's optimizer runs on its piece of every leaf, and such a state on a piece is "
            "not a piece of the whole leaf's; use an element-wise optimizer (SGD, momentum, "
            "Adam, AdamW, Lion) or fsdp=1")


def states(opt_state: Staged, params: Packing, F: int, replica: int = 0) -> list[Any]:
    """The K whole optax states of one replica, as host pytrees, from a
    trainer's state rows (a row per device when F > 1)."""
    K = params.stages
    if F == 1 or not opt_state.buffers:  # no buffers: a stateless optimizer's
        return opt_state.per_stage(replica)
    host = [host_array(b) for b in opt_state.buffers]
    R = host[0].shape[0] // (K * F)
    if not (isinstance(replica, (int, np.integer)) and 0 <= replica < R):
        raise ArgumentTypeError(f"replica={replica!r}; use 0 to {R - 1}")
    rows = [b.reshape(R, K, F, *b.shape[1:])[replica] for b in host]
    return [whole([opt_state.packing.unpack(k, tuple(b[k, f] for b in rows)) for f in range(F)],
                  params, k) for k in range(K)]


def whole(pieces: list[Any], params: Packing, k: int) -> Any:
    """Stage k's optax state over its whole leaves from the F states over
    its pieces (device 0's first); `params` is the whole parameter packing."""
    tree = params.abstract_tree(k)
    each = [state_parts(p, tree) for p in pieces]
    treedef, flat, per_parameter = each[0]
    out = []
    for n, (part, cut) in enumerate(zip(flat, per_parameter)):
        if not cut:
            out.append(part)
            continue
        typed = _typed(params, k, part)
        view = typed.shard(len(pieces))
        rows = [view.pack(k, jax.tree.map(np.asarray, s[1][n])) for s in each]  # per device
        joined = tuple(np.concatenate([np.asarray(r[j]) for r in rows])
                       for j in range(len(params.slots)))
        out.append(typed.unpack(k, joined))
    return jax.tree.unflatten(treedef, out)


def into_pieces(state: Any, params: Packing, k: int, F: int) -> list[Any]:
    """Stage k's whole optax state cut into the F states over its pieces."""
    if F == 1:
        return [state]
    treedef, flat, per_parameter = state_parts(state, params.abstract_tree(k))
    typed = [_typed(params, k, part) if cut else None for part, cut in zip(flat, per_parameter)]
    packed = [[np.asarray(b) for b in t.pack(k, jax.tree.map(np.asarray, part))] if t else None
              for part, t in zip(flat, typed)]
    devices = []
    for f in range(F):
        out = [t.shard(F).unpack(k, tuple(np.split(b, F)[f] for b in rows)) if t else part
               for part, t, rows in zip(flat, typed, packed)]
        devices.append(jax.tree.unflatten(treedef, out))
    return devices


def _typed(params: Packing, k: int, part: Any) -> Packing:
    """`params` with stage k's slots in the dtypes of `part`'s leaves (a
    per-parameter state kept in another dtype than the parameters, such as
    Adam's moments in float32 beside bfloat16 weights, packs without a
    cast: each slot holds one leaf of a stage)."""
    slots = list(params.slots)
    for s, leaf in zip(params.leaves[k], jax.tree.leaves(part)):
        slots[s.slot] = (str(np.dtype(leaf.dtype)), slots[s.slot][1])
    return dataclasses.replace(params, slots=tuple(slots))
