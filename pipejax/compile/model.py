"""The user's model as the compiler holds it (`Model`: what `pj.pipeline`
was given), and what an op of a virtual stage reads besides its weights
and its boundary input (`Feed`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from pipejax.checks import Remat
from pipejax.layers import Layer


class Model(NamedTuple):
    """What the user gave `pj.pipeline`: the layers, the loss of one
    micro-batch, the remat mode, one micro-batch of inputs and targets
    (ShapeDtypeStructs), and the dtype the stages compute in (None: as
    stored; precision.py)."""

    layers: tuple[Layer, ...]
    loss: Callable
    remat: Remat
    example: Any
    targets: Any
    compute_dtype: Any = None
    ties: tuple = ()  # leaves several layers hold as one value (layers/ties.py)


class Feed(NamedTuple):
    """What an op of virtual stage j reads besides its weights and its
    boundary input: its micro-batch's inputs (stage 0) and targets (the last
    stage), the micro-batch's dropout key, and the global index of the
    stage's first layer (the stages of a group share one branch)."""

    x: Any
    y: Any
    key: jax.Array
    first: jax.Array
