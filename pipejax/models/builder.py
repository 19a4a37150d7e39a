"""A zoo model's layer list under construction, in Flax linen or NNX.

Each model writes its architecture once, as a sequence of
`add(linen_layer, nnx_maker)` calls; `api` picks which one is kept. A linen
module infers its input size when initialized, an NNX module takes it when
built: the builder tracks one example's shape through the layers and calls
`nnx_maker(features, rngs)` with the current last axis. One `api` argument
rather than a twin function per model: one signature, one set of defaults and
one architecture to keep right, for both APIs (and the CLI's `--api`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipejax.errors import ConfigError
from pipejax.layers import layer_list

APIS = ("linen", "nnx")


class Builder:
    """`add(linen, make_nnx=None)` appends `linen` (api="linen"), or
    `make_nnx(features, rngs)` (api="nnx"; `linen` as is when `make_nnx` is
    None: a function of one array, shared by both APIs); `.layers` is the list."""

    def __init__(self, model: str, api: str, inputs: int | Sequence[int] | None,
                 rngs: nnx.Rngs | None, dtype: Any = jnp.float32):
        if api not in APIS:
            raise ConfigError(f"pj.models.{model}(api={api!r}); use 'linen' or 'nnx'")
        if api == "nnx" and inputs is None:
            raise ConfigError(f"pj.models.{model}(api='nnx') needs inputs=, the shape of one "
                              "example (40 for an MNIST-1D signal, (8, 8, 1) for an image): NNX "
                              "modules are built with their input sizes")
        self.api = api
        self.x = None if api == "linen" else jax.ShapeDtypeStruct(
            (1, *((int(inputs),) if np.ndim(inputs) == 0 else inputs)), dtype)
        self.rngs = nnx.Rngs(0) if rngs is None else rngs
        self.layers: list = []

    def add(self, linen: Any, make_nnx: Callable[[int, nnx.Rngs], Any] | None = None) -> "Builder":
        if self.api == "linen":
            self.layers.append(linen)
            return self
        layer = linen if make_nnx is None else make_nnx(self.shape[-1], self.rngs)
        self.x = _after(layer, self.x)
        self.layers.append(layer)
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one example where the list ends (of a pair, a residual
        branch and its shortcut, the branch's)."""
        return tuple(jax.tree.leaves(self.x)[0].shape[1:])


def _after(layer: Any, x: Any) -> Any:
    """The abstract output of `layer` on the abstract batch `x` (eval mode)."""
    [layer] = layer_list([layer])
    return jax.eval_shape(lambda x: layer.apply(layer.init(jax.random.key(0), x), x,
                                                train=False), x)
