"""An NNX layer's decode step over its cache (`Decoder`, base.py), by nnx's convention.

`nnx.MultiHeadAttention` keeps its keys and values in `nnx.Cache` variables
that `init_cache(input_shape, dtype)` makes, and reads and extends them when
called with `decode=True`. A copy of the layer on its parameters makes its
cache for a whole window's input; the cache travels between steps as its
variables with, static, the layer's graph that holds them (made at `init`),
so each step merges a module that has them. (A linen layer follows Flax's
decode mode instead: layers/linen.py.)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from flax import nnx

from pipejax.layers.base import Decoder


def cache_decoder(module: Callable[..., nnx.Module], rngs: nnx.State,
                  constants: nnx.State) -> Decoder:
    """The decode step of an NNX layer: `module(params, constants, key,
    train)` makes a throwaway copy on `params` (NnxLayer._module), `rngs`
    its random streams."""
    def init(variables: nnx.State, x: Any) -> _Cache:
        layer = module(variables, constants, None, False)
        leaf = jax.tree.leaves(x)[0]
        layer.init_cache(leaf.shape, leaf.dtype)
        graphdef, _, _, cache, rest = nnx.split(layer, nnx.Param, nnx.RngState, nnx.Cache, ...)
        return _Cache((cache, rest), graphdef)

    def step(variables: nnx.State, cache: _Cache, x: Any) -> tuple[Any, _Cache]:
        layer = nnx.merge(cache.graphdef, variables, rngs, *cache.states, copy=True)
        y = layer(x, decode=True)
        _, _, _, new, rest = nnx.split(layer, nnx.Param, nnx.RngState, nnx.Cache, ...)
        return y, _Cache((new, rest), cache.graphdef)

    return Decoder(init, step)


@jax.tree_util.register_pytree_node_class
class _Cache:
    """An NNX layer's cache and other non-parameter state, with (static) the
    layer's graph that holds them."""

    def __init__(self, states: tuple, graphdef: Any):
        self.states, self.graphdef = states, graphdef

    def tree_flatten(self):
        return (self.states,), self.graphdef

    @classmethod
    def tree_unflatten(cls, graphdef, children):
        return cls(children[0], graphdef)
