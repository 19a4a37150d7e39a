"""Residual pruning: what a stage must keep from its forward to its backward.

With `remat="none"` a stage's forward runs under the `jax.checkpoint`
policy `costly`: it keeps what a matmul, a reduction, a gather, a
transcendental or any other costly primitive made, and its backward makes
the arithmetic and layout values again from those, inside the fusions
that read them, as XLA's fusion does in a plain jit. Then `jax.vjp` closes over residuals of three
kinds. Some are values the backward tick has anyway (the weights, the
stashed stage input, the micro-batch data, the key): those are looked up
again, never copied. Some the vjp never reads (jax carries them along):
those are rebuilt as zeros of the right shape. Only the rest is packed into
the kept-residual ring buffer. With `remat="none"` this halved what a stage
keeps (measured on the MLP).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.extend.core.primitives import reduce_precision_p

from pipejax.errors import ConfigError


# Primitives a backward makes again for free from the values it reads anyway
# (arithmetic, comparisons, casts, layout): XLA fuses them into their
# consumers. Any other primitive's values are kept, transcendentals (exp,
# tanh, erf, logistic, log, pow, the trigonometric ones) too: on a CPU one
# costs like a small matmul, and the zoo GPT's stage (3 blocks, width 128,
# micro-batch 4x128) made its softmax's exp and its GELU's tanh again in
# every backward, in B and in W alike: keeping them took F + BW from 44.6
# to 41.4 ms (bench/op_times.py, one pinned core). The sharding annotations
# are here because shard_map stages them on constants.
_REMADE = frozenset("""
    abs add add_any and bitcast_convert_type broadcast_in_dim ceil clamp complex concatenate
    conj convert_element_type copy div dynamic_slice eq floor ge gt imag integer_pow iota
    is_finite le lt max min mul ne neg nextafter not or pad pvary real reduce_precision rem
    reshape reshard rev round rsqrt select_n sharding_constraint shift_left
    shift_right_arithmetic shift_right_logical sign slice split sqrt square squeeze
    stop_gradient sub transpose xor""".split())


# Call primitives whose body a backward can make again when every equation
# in it is remade (nn.relu and softplus are custom_jvp_calls, jnp.clip and
# nn.silu jitted calls), with the parameter that holds the body.
_CALLS = {"custom_jvp_call": "call_jaxpr", "jit": "jaxpr", "pjit": "jaxpr",
          "closed_call": "call_jaxpr"}


def _remade(name: str, params: dict) -> bool:
    """Whether a primitive's values are made again rather than kept."""
    if name in _REMADE:
        return True
    body = params.get(_CALLS.get(name, ""))
    body = getattr(body, "jaxpr", body)
    return body is not None and all(
        _remade(eqn.primitive.name, eqn.params) for eqn in body.eqns)


def costly(prim: Any, *_: Any, **params: Any) -> bool:
    """remat "none"'s `jax.checkpoint` policy: keep the values of costly
    primitives, make the arithmetic ones again in the backward.

    Kept whole, jax.vjp's residuals held every intermediate of a layer (a
    tanh GELU's, layer norm's centred and scaled input): on the zoo GPT
    (depth 14, width 128, K = 4, micro-batch 4x128) 49.1 MiB a micro-batch
    per stage against 17.8 MiB under this policy (13.8 where it made the
    transcendentals again too), and 1F1B's step took 0.86 of remat
    "stage"'s time against 0.78 (that policy; alternated in one process):
    the ring's writes and reads cost more than the arithmetic they saved.
    A call of remade primitives alone is remade too: a Dense then relu
    stage kept the relu's output beside the Dense's, twice what it needs."""
    return not _remade(prim.name, params)


def _rounds_nothing(eqn: Any) -> bool:
    """A `reduce_precision` to its own float32 (or float64) format: the
    identity, on every backend (none computes these wider)."""
    if eqn.primitive is not reduce_precision_p:
        return False
    dtype = eqn.invars[0].aval.dtype
    if dtype not in (np.float32, np.float64):
        return False
    info = jnp.finfo(dtype)
    return (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]) == (info.nexp, info.nmant)


def vjp(fn: Callable, *primals: Any) -> tuple[Any, Callable]:
    """`jax.vjp(fn, *primals)` without the rounding `jax.checkpoint` puts
    on every value it saves (jax PR 22244: a bfloat16 value computed wider
    must be kept as its backward would make it again). For a float32 value
    it rounds nothing, yet XLA:CPU copies each one: 23 copies, 0.9 ms of
    the 12 ms forward of a zoo GPT stage (3 blocks, width 128, micro-batch
    4x128; bench/op_times.py). Those are dropped; narrower ones stay."""
    tree = []

    def flat(*args):
        leaves, treedef = jax.tree.flatten(jax.vjp(fn, *args))
        tree.append(treedef)
        return leaves
    closed = jax.make_jaxpr(flat)(*primals)
    same: dict = {}
    again = lambda v: same.get(v, v) if isinstance(v, core.Var) else v
    eqns = []
    for eqn in closed.jaxpr.eqns:
        if _rounds_nothing(eqn):
            same[eqn.outvars[0]] = again(eqn.invars[0])
        else:
            eqns.append(eqn.replace(invars=[again(v) for v in eqn.invars]))
    jaxpr = closed.jaxpr.replace(eqns=eqns, outvars=[again(v) for v in closed.jaxpr.outvars])
    leaves = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves(primals))
    return jax.tree.unflatten(tree[0], leaves)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Where each vjp residual comes from at the backward tick."""

    steps: tuple[tuple[str, Any], ...]  # ("known", j) | ("kept", i) | ("unused", aval)
    treedef: Any


def _read_leaves(leaves: Sequence[Any], treedef: Any, out: Any) -> list[bool]:
    """Which residual leaves the vjp reads."""
    struct = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
    jaxpr = jax.make_jaxpr(lambda ls, ct: jax.tree.unflatten(treedef, ls)(ct))(
        [struct(x) for x in leaves], jax.tree.map(struct, out)).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars[:len(leaves)]]


def split(vjp_fn: Any, known: Sequence[Any], out: Any) -> tuple[list, Recipe]:
    """The residual leaves of `vjp_fn` to keep, and the recipe that rebuilds
    the vjp from them and the `known` values (matched by identity)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    steps, kept = [], []
    for leaf, read in zip(leaves, _read_leaves(leaves, treedef, out)):
        j = next((j for j, x in enumerate(known) if leaf is x), None)
        if j is not None:
            steps.append(("known", j))
        elif not read:
            steps.append(("unused", jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))))
        else:
            steps.append(("kept", len(kept)))
            kept.append(leaf)
    return kept, Recipe(tuple(steps), treedef)


def rebuild(recipe: Recipe, known: Sequence[Any], kept: Sequence[Any]) -> Callable:
    """The vjp function again, from the known values and the kept residuals."""
    pick = {"known": lambda j: known[j], "kept": lambda i: kept[i],
            "unused": lambda aval: jnp.zeros(aval.shape, aval.dtype)}
    return jax.tree.unflatten(recipe.treedef, [pick[kind](arg) for kind, arg in recipe.steps])


def check(kept: Sequence[Any], layout: Sequence[Any], stage: str, remat: Any) -> None:
    """Raise unless the residuals a stage keeps inside the program are its
    kept ring's `layout`, traced outside `shard_map`. A policy that saves
    values made of constants sees them only inside, where `shard_map`
    stages them (the `reshard` of a constant); without this check the
    ring's write failed deep in XLA's shape checks."""
    got = [(tuple(jnp.shape(x)), jnp.dtype(jnp.result_type(x))) for x in kept]
    want = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in layout]
    if got != want:
        i, (inside, laid) = next((i, pair) for i, pair in
                                 enumerate(itertools.zip_longest(got, want)) if pair[0] != pair[1])
        show = lambda aval: "nothing" if aval is None else f"{aval[1].name}{list(aval[0])}"
        raise ConfigError(
            f"{stage}: remat={remat!r} keeps {len(got)} residuals inside the pipeline's program "
            f"but {len(want)} in its kept ring's layout (traced outside shard_map); residual {i} "
            f"is {show(inside)} inside and {show(laid)} in the layout. The policy saves a value "
            "made of constants, which shard_map stages: save only values computed from the "
            "stage's inputs (e.g. jax.checkpoint_policies.dots_saveable) or use remat=\"none\"")
