"""The switch branches of a pipeline's stage code: what one op of one
virtual stage runs, as the table interpreter calls it.

Each function builds one branch per group of virtual stages of one
structure (`StageCode.groups`), reading the stage's trees out of the packed
slot buffers: the forward F, the fused backward BW, zero bubble's B and W
(split.py), the last stage's fused forward and backward. A branch reads its
chunk's part of its device's parameter tree and returns gradients for the
whole device tree (its other chunks' slots zero).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pipejax.compile import rows
from pipejax.packing import Buffers
from pipejax.compile.model import Feed
from pipejax.compile.stages import StageCode


def _device_grads(code: StageCode, j: int, grads: Any) -> Buffers:
    """Virtual stage j's gradients packed into its device's tree (its
    other chunks' slots zero)."""
    k = code.placement.device(j)
    tree = list(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             code.params.abstract_tree(k)))
    tree[code.slice_of(j)] = grads
    return code.params.pack(k, tree)


def _add_grads(code: StageCode, j: int, grad_sum: Buffers, grads: Any) -> Buffers:
    """The device's gradient sum with virtual stage j's gradients added into
    its own slots only (the other chunks' pass through)."""
    return code.params.add(code.placement.device(j), grad_sum, grads, code.first_leaf(j))


def _chunk(code: StageCode, j: int, p: Buffers) -> Any:
    """Virtual stage j's parameters out of its device's buffers."""
    return code.params.unpack(code.placement.device(j), p)[code.slice_of(j)]


def _stage_input(code: StageCode, j: int, h: Buffers) -> Any:
    """Virtual stage j's input out of its input slot (None for the first)."""
    return code.acts.unpack(j - 1, h) if j > 0 else None


def forward(code: StageCode) -> list[Callable]:
    """The branch of virtual stage j's group: ((params, input slot,
    (x_m, y_m, key, first), row), (kept ring, _, _)) -> (the kept ring with
    the residuals written into its row, message for j + 1, loss); the last
    stage's message is empty and its loss is the micro-batch loss, the
    others' loss 0. Run them with `code.groups.run`: each group's loop
    updates the ring in place, its residuals written where they are made.
    A last stage whose backward runs its forward (`code.deferred`,
    last_stage.py) never takes its branch: it hands the carry on."""
    S, acts, kept = code.S, code.acts, code.kept

    def branch(j):
        if j == S - 1 and code.deferred:
            return lambda operands, carry: (carry[0], acts.zeros(), jnp.zeros((), jnp.float32))

        def run(operands, carry):
            p, h, micro, row = operands
            out, res, _ = code.vjp(j, _chunk(code, j, p), _stage_input(code, j, h), Feed(*micro))
            ring = rows.write(kept, j, carry[0], row, res)
            if j == S - 1:
                return ring, acts.zeros(), out.astype(jnp.float32)
            return ring, acts.pack(j, out), jnp.zeros((), jnp.float32)
        return run

    return code.groups.branches(branch)


def backward(code: StageCode, into_sum: bool = False) -> list[Callable]:
    """The branch of virtual stage j's group, the fused backward BW:
    (params, input slot, gradient slot, kept slot, micro) -> (packed
    parameter gradients of the device, message for j − 1). `into_sum`:
    ((params, slots..., micro), (gradient sum, message)) -> (the sum with
    the chunk's gradients added, message), for `StageGroups.run`. A last
    stage whose backward runs its forward (`code.deferred`) runs as the
    pair (`fused`), never this branch: it hands the carry on (or zeros)."""
    def branch(j):
        if j == code.S - 1 and code.deferred:
            return (lambda operands, carry: carry) if into_sum else (
                lambda *operands: (code.params.zeros(), code.acts.zeros()))

        def grads(p, h, ct, r, micro):
            dparams, dh = code.backward(j, *_unpack_backward(code, j, p, (h, ct, r), micro))
            return dparams, _message_back(code, j, dh)

        def run(*operands):
            dparams, msg = grads(*operands)
            return _device_grads(code, j, dparams), msg

        def add(operands, carry):
            dparams, msg = grads(*operands)
            return _add_grads(code, j, carry[0], dparams), msg
        return add if into_sum else run

    return code.groups.branches(branch)


def _unpack_backward(code: StageCode, j: int, p: Buffers, slots: tuple, micro: tuple) -> tuple:
    """(params, h, feed, kept leaves, ct) of virtual stage j from its buffers
    and its ring slots (input, output gradient or None, and the kept ring
    with the row to read)."""
    h, ct, (ring, row) = slots
    ct = None if j == code.S - 1 or ct is None else code.acts.unpack(j, ct)
    return (_chunk(code, j, p), _stage_input(code, j, h), Feed(*micro),
            jax.tree.leaves(rows.read(code.kept, j, ring, row)), ct)


def _message_back(code: StageCode, j: int, dh: Any) -> Buffers:
    return code.acts.pack(j - 1, dh) if j > 0 else code.acts.zeros()


def input_grad(code: StageCode) -> list[Callable]:
    """The branch of virtual stage j's group, zero bubble's B: ((params,
    input slot, gradient slot, (kept ring, row), micro, bridge row),
    (bridge ring, _, loss)) -> (the bridge ring with what W needs written
    into its row, message for j − 1, loss): the micro-batch's loss where
    B runs the last stage's forward too (`code.deferred`, last_stage.py),
    else the loss handed in. Run them with `code.groups.run`."""
    def branch(j):
        split = code.splits[code.groups.of[j]]
        makes_loss = j == code.S - 1 and code.deferred

        def run(operands, carry):
            p, h, ct, r, micro, row = operands
            args = _unpack_backward(code, j, p, (h, ct, r), micro)
            dh, bridge = split.run_b(jax.tree.leaves(args))
            loss = dh.pop() if makes_loss else carry[2]
            dh = jax.tree.unflatten(jax.tree.structure(code.input_of(j)), dh) if j > 0 else None
            return (rows.write(code.bridge, j, carry[0], row, bridge), _message_back(code, j, dh),
                    loss)
        return run

    return code.groups.branches(branch)


def weight_grad(code: StageCode, into_sum: bool = False) -> list[Callable]:
    """The branch of virtual stage j's group, zero bubble's W: (params,
    input slot, (kept ring, row), (bridge ring, row), micro) -> packed
    parameter gradients of the device. `into_sum`: ((params, slots...,
    micro), gradient sum) -> the sum with the chunk's gradients added."""
    def branch(j):
        split = code.splits[code.groups.of[j]]

        def grads(p, h, r, b, micro):
            params, h_in, feed, kept, _ = _unpack_backward(code, j, p, (h, None, r), micro)
            reread = jax.tree.leaves((params, h_in, feed, kept))
            flat = split.run_w(reread, jax.tree.leaves(rows.read(code.bridge, j, *b)))
            return jax.tree.unflatten(jax.tree.structure(params), flat)

        run = lambda *operands: _device_grads(code, j, grads(*operands))
        add = lambda operands, grad_sum: _add_grads(code, j, grad_sum, grads(*operands))
        return add if into_sum else run

    return code.groups.branches(branch)


def fused(code: StageCode, p: Any, h: Any, micro: tuple) -> tuple:
    """Inside shard_map: `StageCode.pair`, the last stage's forward and
    backward as one vjp where the table runs them in one tick
    (`Schedule.fused`) or its BW runs the forward (`code.deferred`):
    (loss, packed parameter gradients, message for the stage before)."""
    j = code.S - 1
    loss, dparams, dh = code.pair(_chunk(code, j, p), _stage_input(code, j, h), Feed(*micro))
    return loss.astype(jnp.float32), _device_grads(code, j, dparams), _message_back(code, j, dh)
