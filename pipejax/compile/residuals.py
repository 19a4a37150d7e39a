"""Residual pruning: what a stage must keep from its forward to its backward.

`jax.vjp` closes over residuals of three kinds. Some are values the backward
tick has anyway (the weights, the stashed stage input, the micro-batch data,
the key): those are looked up again, never copied. Some the vjp never reads
(jax carries them along): those are rebuilt as zeros of the right shape.
Only the rest is packed into the kept-residual ring buffer. With
`remat="none"` this halved what a stage keeps (measured on the MLP).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


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
