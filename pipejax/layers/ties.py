"""Tied weights: one module's parameters used by two or more layers of a list.

GPT-2 and most small language models use one matrix as the input embedding
and the output head. In a layer list the module is held by two layers (a
linen module in a field of each, or listed itself and held in another's
field; an NNX module held by two), and each layer, traced alone, has its
own copy of the module's parameters. A `Tie` says which leaves of which
layers hold one value, the first holder's; `layer_list(..., shared=...)`
records the shared modules and `leaf_ties` turns them into ties, leaf by
leaf. The pipeline keeps the copies equal (pipejax/compile/ties.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax

from pipejax.errors import LayerError

Path = tuple[str, ...]  # a key path in a layer's variables, as names
Leaf = tuple[int, Path]  # (layer index, the path of a leaf or a subtree in its variables)


class Tie(NamedTuple):
    """Leaves of several layers that hold one value: the first holder's."""

    holders: tuple[Leaf, ...]


def names(path: tuple) -> Path:
    """A jax key path as names; an NNX Variable's `.value` step left out."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                 for k in path if not isinstance(k, jax.tree_util.GetAttrKey))


def leaf_ties(shared: Sequence[tuple[Leaf, Leaf]], variables: Sequence[Any],
              layer_names: Sequence[str]) -> tuple[Tie, ...]:
    """The ties of `shared` (pairs (first holder, other holder) of one
    module's subtree or leaf, in the layers' `variables`), leaf by leaf.

    Raises:
      LayerError: naming both layers, when the two subtrees differ.
    """
    groups: dict[Leaf, list[Leaf]] = {}
    for (i, at_i), (j, at_j) in shared:
        mine, theirs = _under(variables[i], at_i), _under(variables[j], at_j)
        if [(p, s.shape, s.dtype) for p, s in mine] != [(p, s.shape, s.dtype) for p, s in theirs]:
            raise LayerError(
                f"layers {i} ({layer_names[i]}) and {j} ({layer_names[j]}) share a module, but "
                f"its parameters under {'.'.join(at_i)} and {'.'.join(at_j)} differ "
                f"({len(mine)} and {len(theirs)} arrays); tie a module held in a field (not "
                "in a list or dict) or listed itself")
        for (rest, _), _ in zip(mine, theirs):
            first = (i, at_i + rest)
            for root, held in groups.items():  # a module shared by three layers: one group
                if first in held:
                    first = root
            groups.setdefault(first, [first]).append((j, at_j + rest))
    return tuple(Tie(tuple(held)) for held in groups.values())


def _under(variables: Any, at: Path) -> list[tuple[Path, Any]]:
    """The leaves of `variables` whose path starts with `at`, by the rest of their path."""
    return [(names(p)[len(at):], leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(
        variables)[0] if names(p)[:len(at)] == at]
