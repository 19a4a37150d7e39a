"""Layers: the user's list turned, once, into objects of one interface.

A layer list holds Flax linen modules (linen.py), Flax NNX modules (nnx.py)
and functions of one array (function.py); `layer_list` wraps each entry in
its kind's adapter, which offers the `Layer` interface (base.py): name,
init, initial values, apply, the state it would keep, and equality for
branch sharing. Everything downstream (trace, stage code, simulators,
evaluation) runs layers through that interface without asking their kind.
`apply_layers` runs a contiguous run of layers with the key of each layer
derived from its global index, so any split into stages draws the same numbers.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipejax import caches
from pipejax.errors import LayerError
from pipejax.layers import nnx
from pipejax.layers.base import Decoder, Layer, Variables
from pipejax.layers.function import FunctionLayer, function_name
from pipejax.layers.linen import LinenLayer, own_submodules
from pipejax.layers.nnx import NnxLayer

_ADAPTERS = (LinenLayer, NnxLayer, FunctionLayer)


def _wrap(layers: Sequence[Any], i: int, owner: dict, shared: list | None) -> Layer:
    """Entry `i` of `layers` as its kind's adapter (an adapter as it is);
    `owner` records which layer holds each module, to find shared ones."""
    layer = layers[i]
    if isinstance(layer, _ADAPTERS):
        return layer
    if nnx.is_nnx(layer):
        return nnx.wrap(layers, i, owner, shared)
    if isinstance(layer, nn.Module):
        own_submodules(layers, i, owner, shared)
        return LinenLayer(layer)
    if callable(layer):
        return FunctionLayer(layer)
    raise LayerError(f"layer {i} ({function_name(layer)}) is neither a Flax module nor a "
                     "callable; a layer list holds Flax modules (linen or NNX) or functions of "
                     "one array")


def layer_list(layers: Any, shared: list | None = None) -> tuple[Layer, ...]:
    """The entries of `layers` (a list or tuple, an `nnx.Sequential` or an
    `nnx.List`) as `Layer`s; entries that already are pass through. With a
    `shared` list, modules two layers share are appended to it (tied
    weights, ties.py) instead of being an error.

    Raises:
      LayerError: when `layers` is not a list, an entry is neither a module
        nor a function, or (without `shared`) two layers share variables or
        a module (nnx.py, linen.py): each layer would train its own copy.
    """
    entries = nnx.items(layers)
    if entries is None:
        raise LayerError(f"layers must be a list of Flax modules or functions (or an "
                         f"nnx.Sequential), not {type(layers).__name__}; a model is a list so it "
                         "can be split")
    owner: dict[int, tuple] = {}  # id of a module or variable -> (its layer, its path there)
    return tuple(_wrap(entries, i, owner, shared) for i in range(len(entries)))


def remembered(memory: collections.deque | list, layers: Sequence[Layer], kind: Any,
               compute: Callable[[], Any]) -> Any:
    """`compute()` for the first run of equal layers (`Layer.same`: one
    function of their variables and input) of equal `kind`, its value after;
    `memory` holds (layers, kind, value). What depends only on the layers'
    functions and shapes (a layer's analysis, a stage's residuals) is worked
    out once for all pipelines of a process: `pj.search` builds one list many
    times. The memory keeps each layer without the values it arrived with
    (`Layer.without_values`: an NNX module's parameters), so a process-wide
    one holds no model alive and NNX layers are remembered as linen ones
    (`pj.search` over a 2-block NNX decoder: each candidate had traced and
    compiled its stages again); `compute` must return nothing that holds them."""
    def same(entry: tuple, key: tuple) -> bool:
        (others, other_kind), (mine, my_kind) = entry, key
        return (other_kind == my_kind and len(others) == len(mine)
                and all(o.same(layer) for o, layer in zip(others, mine)))

    return caches.recall(memory, (layers, kind), compute, same,
                           kept=(tuple(layer.without_values() for layer in layers), kind))


def abstract(tree: Any) -> Any:
    """A tree of arrays (or numbers) as `ShapeDtypeStruct`s."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def shapes(tree: Any) -> tuple:
    """A tree's structure with the shape and dtype of every leaf, comparable with ==."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)


def layer_variables(layer: Layer, x: Any, key: jax.Array, index: int) -> Variables:
    """Layer `index`'s initial variables for an input shaped like `x`: the
    values it arrives with (NNX), else its init with fold_in(key, index) from
    a program compiled once per process for equal layers on equal input
    shapes (the index an argument)."""
    given = layer.initial_values()
    if given is not None:
        return given

    def layer_init(key: jax.Array, i: jax.Array) -> Variables:
        return layer.init(layer_key(key, i), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), x))

    init = remembered(caches.INITS, [layer], ("init", shapes(x)), lambda: jax.jit(layer_init))
    return init(key, index)


def initial_variables(layers: Sequence[Layer], example: Any, key: jax.Array) -> list[Variables]:
    """Every layer's initial variables for inputs shaped like `example` (one
    micro-batch), each as `layer_variables` makes it: the values
    `pj.unstage(pipe.init(key))` gives, without building a pipeline."""
    out, h = [], abstract(example)
    for i, layer in enumerate(layer_list(layers)):
        out.append(layer_variables(layer, h, key, i))
        h = jax.eval_shape(lambda v, x, layer=layer: layer.apply(v, x, None, train=False),
                           out[-1], h)
    return out


def layer_key(key: jax.Array, index: int) -> jax.Array:
    """The key of layer `index` (global position in the list) for one micro-batch."""
    return jax.random.fold_in(key, index)


def apply_layers(layers: Sequence[Any], variables: Sequence[Variables], h: Any,
                 key: jax.Array | None = None, train: bool = True, first: int = 0) -> Any:
    """Run a contiguous run of layers sequentially; `first` is the global index
    of `layers[0]`, so keys match however the list is split into stages.
    `layers` may be the user's list (wrapped here)."""
    for i, (layer, v) in enumerate(zip(layer_list(layers, []), variables)):  # tied: copies
        k = None if key is None else layer_key(key, first + i)
        h = layer.apply(v, h, k, train)
    return h


__all__ = ["Decoder", "FunctionLayer", "Layer", "LinenLayer", "NnxLayer", "Variables",
           "abstract", "apply_layers", "initial_variables", "layer_key", "layer_list",
           "layer_variables", "nnx", "shapes"]
