"""The operand order of zero bubble's weight-gradient contractions.

XLA's CPU backend runs a `dot_general` as a matrix product of its left
operand laid out [M, K] (the contracted axes last) and its right one laid
out [K, N] (the contracted axes first). A weight gradient contracts over
the tokens, which lead both operands (a Dense's Σ_t x[t, i] dy[t, o]), so
one operand is relaid whatever the order. A value W reads from a ring (a
bridge row, a kept residual, the stage input), or one that several
equations read (made once, in one layout), is copied first; a value made
for that contraction alone is written relaid by the fusion that makes it,
which costs about half as much a byte. W runs each contraction in the
order that relays fewer of those bytes, behind an optimization barrier so
that XLA keeps it.

Measured on the zoo GPT (depth 6, width 128, M = 8, remat "none", K = 2
in 2 pinned processes as `benchmarks/cores.py` runs them, the variants
alternated in one job, fastest of 8 steps each):
- counting a value made for one contraction as free to relay made W
  build the GELU's output transposed from two kept rows, a loop fusion of
  2.3 ms a call, where relaying the cotangent it meets (a quarter of the
  bytes) and the product take 0.7 ms together; counted at half its bytes,
  zb-h1's step went from 522 to 500 ms (1F1B: 486);
- without the barrier, XLA folded the transpose that follows each weight
  gradient in jax's transpose rule into the dot, swapping its operands
  back into a generic dot that reads its left operand transposed; with
  it, zb-h1 took 474 ms, 1F1B 472.
On one process (depth 14, K = 1, `benchmarks/table_speed.py`), zb-h1
took 1.24× 1F1B's step where it relaid the attention's q, k and v
cotangents, filed in the bridge as (batch, tokens, heads, head width),
instead of the layer norm's output; 1.25× counting the ring's values
alone (a sum of cotangents that a weight gradient and the next sum both
read was then relaid); 1.11× counting what several equations read.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Collection, Mapping, Sequence

import jax

from pipejax.trace import nbytes

# Equations whose output is their input's bytes in the same order: a value
# read from a ring stays one through them.
_SAME_BYTES = frozenset({"reshape", "squeeze", "expand_dims"})
# What relaying a value costs, per byte, where the fusion that makes it
# for one contraction writes it in the layout that contraction wants,
# against copying a laid-out value of the same bytes (module docstring).
_MADE = 0.5


def _fits(contract: Sequence[int], ndim: int, left: bool) -> bool:
    """Whether an operand's contracted axes lie where XLA's CPU dot wants
    them: last on the left, first on the right."""
    want = range(ndim - len(contract), ndim) if left else range(len(contract))
    return tuple(sorted(contract)) == tuple(want)


def _relaid(x: Any, contract: Sequence[int], left: bool, laid: set,
            aval: Mapping[int, Any]) -> float:
    """The bytes XLA copies to lay operand `x` out on the left (`left`) or
    the right of a dot: none where it lies as the side wants, half of them
    where the fusion that makes it for this dot alone writes it relaid."""
    if not isinstance(x, int) or _fits(contract, len(aval[x].shape), left):
        return 0
    return nbytes(aval[x]) * (1 if x in laid else _MADE)


def ordered(node: Any) -> bool:
    """Whether this module orders a jaxpr node: a `dot_general` without
    batch axes or a sharding of its output's axes, as a weight gradient is
    (the attention's batched contractions are left to XLA)."""
    return (node.primitive.name == "dot_general" and not node.params["dimension_numbers"][1][0]
            and node.params.get("out_sharding") is None)


def orders(nodes: Sequence[Any], which: Sequence[int], fixed: Collection[int],
           aval: Mapping[int, Any]) -> dict[int, bool]:
    """W's contractions among the `nodes` `which` (in order), each with
    whether to run it with its operands swapped: where that relays fewer
    bytes of laid-out values. A value is laid out where it is read from a
    ring (`fixed`, and what reshapes it) or read by more than one equation
    (made once, in one layout). Only the `ordered` nodes count."""
    readers = collections.Counter(r for i in which for r in nodes[i].ins if isinstance(r, int))
    laid = set(fixed) | {r for r, n in readers.items() if n > 1}
    out = {}
    for i in which:
        node = nodes[i]
        name = node.primitive.name
        if name in _SAME_BYTES and node.ins[0] in laid:
            laid.update(node.outs)
        if not ordered(node):
            continue
        (lc, rc), _ = node.params["dimension_numbers"]
        a, b = node.ins
        kept = _relaid(a, lc, True, laid, aval) + _relaid(b, rc, False, laid, aval)
        out[i] = _relaid(b, rc, True, laid, aval) + _relaid(a, lc, False, laid, aval) < kept
    return out


def bind(primitive_bind: Callable, params: dict, a: Any, b: Any, swap: bool) -> Any:
    """`dot_general(a, b)`, bound as `dot_general(b, a)` with its output's
    axes put back where `swap`: (batch, b's free axes, a's) transposed to
    (batch, a's, b's). The product sits behind an optimization barrier:
    jax's transpose rule writes a weight gradient as a contraction and a
    transpose, and XLA folds that transpose into the dot by swapping its
    operands back, as a generic dot that reads its left operand transposed
    (a GELU's W at the GPT's width 128 on one pinned core: 1.2 ms, where
    the product in the chosen order and the transpose take 0.7)."""
    if not swap:
        return jax.lax.optimization_barrier(primitive_bind(a, b, **params))
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    out = jax.lax.optimization_barrier(
        primitive_bind(b, a, **{**params, "dimension_numbers": ((rc, lc), (rb, lb))}))
    batch, free_b = len(lb), b.ndim - len(rc) - len(rb)
    return jax.lax.transpose(out, (*range(batch), *range(batch + free_b, out.ndim),
                                   *range(batch, batch + free_b)))
