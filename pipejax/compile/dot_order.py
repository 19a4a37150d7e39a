"""The operand order of zero bubble's weight-gradient contractions.

XLA's CPU backend runs a `dot_general` as a matrix product of its left
operand laid out [M, K] (the contracted axes last) and its right one laid
out [K, N] (the contracted axes first). A weight gradient contracts over
the tokens, which lead both operands (a Dense's Σ_t x[t, i] dy[t, o]), so
one operand is relaid whatever the order. A fusion writes a value made
for one reader in whatever layout that reader wants, so relaying it costs
nothing; a value W reads from a ring (a bridge row, a kept residual, the
stage input), or one that several equations read (made once, in one
layout), is copied first. W runs a contraction with its operands swapped
(and its output transposed back) where that relays fewer bytes of those.
On the zoo GPT (depth 14, width 128, M = 8, remat "none";
`benchmarks/table_speed.py`) the attention's q, k and v cotangents, filed
in the bridge as (batch, tokens, heads, head width), were each copied to
[heads · head width, tokens] in W; with the layer norm's output (which W
makes for that matmul alone) relaid instead, zb-h1 takes 1.11× 1F1B's
step where it took 1.24× (K = 1), zb-v 1.03× where it took 1.12× (K = 4).
Counting the ring's values alone swapped 57 of W's 85 contractions at
K = 1 and left zb-h1 at 1.25× (alternated in one process): a sum of
cotangents (`add_any`) that a weight gradient and the next sum both read
was then relaid instead.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Collection, Mapping, Sequence

import jax

from pipejax.trace import nbytes

# Equations whose output is their input's bytes in the same order: a value
# read from a ring stays one through them.
_SAME_BYTES = frozenset({"reshape", "squeeze", "expand_dims"})


def _fits(contract: Sequence[int], ndim: int, left: bool) -> bool:
    """Whether an operand's contracted axes lie where XLA's CPU dot wants
    them: last on the left, first on the right."""
    want = range(ndim - len(contract), ndim) if left else range(len(contract))
    return tuple(sorted(contract)) == tuple(want)


def _held(x: Any, laid: set) -> bool:
    """Whether ref `x` (an int, or a literal) is among the values `laid`."""
    return isinstance(x, int) and x in laid


def _relaid(x: Any, contract: Sequence[int], left: bool, laid: set,
            aval: Mapping[int, Any]) -> int:
    """The bytes XLA copies to lay operand `x` out on the left (`left`) or
    the right of a dot: none where it is made for this dot alone or lies
    as the side wants."""
    if not _held(x, laid) or _fits(contract, len(aval[x].shape), left):
        return 0
    return nbytes(aval[x])


def swapped(nodes: Sequence[Any], which: Sequence[int], fixed: Collection[int],
            aval: Mapping[int, Any]) -> frozenset[int]:
    """The `dot_general` nodes among `which` (in order) to run with their
    operands swapped: those that relay fewer bytes of laid-out values that
    way. A value is laid out where it is read from a ring (`fixed`, and
    what reshapes it) or read by more than one equation (made once, in one
    layout). Contractions with batch axes, or with a sharding of their
    output's axes, keep their order."""
    readers = collections.Counter(r for i in which for r in nodes[i].ins if isinstance(r, int))
    laid = set(fixed) | {r for r, n in readers.items() if n > 1}
    out = set()
    for i in which:
        node = nodes[i]
        name = node.primitive.name
        if name in _SAME_BYTES and _held(node.ins[0], laid):
            laid.update(node.outs)
        if (name != "dot_general" or node.params["dimension_numbers"][1][0]
                or node.params.get("out_sharding") is not None):
            continue
        (lc, rc), _ = node.params["dimension_numbers"]
        a, b = node.ins
        kept = _relaid(a, lc, True, laid, aval) + _relaid(b, rc, False, laid, aval)
        if _relaid(b, rc, True, laid, aval) + _relaid(a, lc, False, laid, aval) < kept:
            out.add(i)
    return frozenset(out)


def bind_swapped(bind: Callable, params: dict, a: Any, b: Any) -> Any:
    """`dot_general(a, b)` bound as `dot_general(b, a)` with its output's
    axes put back: (batch, b's free axes, a's) transposed to (batch, a's,
    b's)."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    out = bind(b, a, **{**params, "dimension_numbers": ((rc, lc), (rb, lb))})
    batch, free_b = len(lb), b.ndim - len(rc) - len(rb)
    return jax.lax.transpose(out, (*range(batch), *range(batch + free_b, out.ndim),
                                   *range(batch, batch + free_b)))
