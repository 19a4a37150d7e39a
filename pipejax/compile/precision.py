"""Mixed precision: float32 master weights, stages that compute in a lower dtype.

`pj.pipeline(..., compute_dtype=jnp.bfloat16)` keeps the parameters, their
gradients and the optimizer state as stored (float32 master weights) and
casts, inside each stage, the float32 weights and the stage's input to the
compute dtype: the stage's layers run in bf16, and its output (a boundary
activation) and its input's gradient travel through `ppermute` and the ring
buffers in bf16, half the bytes. The cast's vjp hands float32 gradients back
to the float32 weights, summed in float32; the last stage casts its outputs
to float32 before the loss. A layer that sets its own Flax `dtype` keeps its
weights as stored (it casts them itself), and weights stored in another
dtype than float32 (a layer's `param_dtype`) are left alone.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from pipejax.layers import Layer


def cast_floating(tree: Any, dtype: Any) -> Any:
    """`tree` with its floating-point leaves in `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def compute_weights(layers: Sequence[Layer], variables: Sequence[Any], dtype: Any) -> list:
    """Each layer's variables as it computes with them under `dtype`: float32
    leaves cast, unless the layer sets its own Flax `dtype`."""
    cast = lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x
    return [v if layer.dtype is not None else jax.tree.map(cast, v)
            for layer, v in zip(layers, variables)]
