"""One optax transformation per stage, from what a user passes as the optimizer.

`pipe.trainer(optimizer)` and `pj.simulate(..., optimizer)` take an optax
`GradientTransformation` (the same for every stage) or a function
`StageInfo -> GradientTransformation`, so that staleness-aware transforms
get their stage's delay and horizons.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optax

from pipejax.errors import ArgumentTypeError
from pipejax.schedules import StageInfo
from pipejax.transforms.mitigations import Mitigation

Optimizer = Any  # optax.GradientTransformation | Callable[[StageInfo], GradientTransformation]


def per_stage(optimizer: Optimizer, infos: Sequence[StageInfo]
              ) -> tuple[optax.GradientTransformation, ...]:
    """The transformation of every stage of `infos`; a clear error for anything else."""
    if isinstance(optimizer, optax.GradientTransformation):
        return (optimizer,) * len(infos)
    if isinstance(optimizer, Mitigation):
        raise ArgumentTypeError("got a pj.transforms.Mitigation; pass its .optimizer (and build "
                                "the pipeline with weight_stashing=mitigation.weight_stashing)")
    if (not callable(optimizer) or isinstance(optimizer, type)
            or getattr(optimizer, "__module__", "").split(".")[0] == "optax"):
        raise ArgumentTypeError(
            f"optimizer must be an optax GradientTransformation (e.g. optax.adam(1e-3)) or a "
            f"function StageInfo -> GradientTransformation, not {_describe(optimizer)}")
    transforms = tuple(_call(optimizer, info) for info in infos)
    bad = [k for k, t in enumerate(transforms) if not isinstance(t, optax.GradientTransformation)]
    if bad:
        raise ArgumentTypeError(
            f"the optimizer function returned {type(transforms[bad[0]]).__name__} for stage "
            f"{bad[0]}; it must return an optax GradientTransformation for every StageInfo")
    return transforms


def _call(optimizer: Callable, info: StageInfo) -> Any:
    try:
        return optimizer(info)
    except TypeError as e:
        raise ArgumentTypeError(
            f"calling the optimizer function with {info} failed ({e}); pass an optax "
            "GradientTransformation such as optax.adam(1e-3), not the function that makes one, "
            "or a function StageInfo -> GradientTransformation") from e


def _describe(optimizer: Any) -> str:
    if isinstance(optimizer, type):
        return f"the class {optimizer.__name__} (pass an instance)"
    if callable(optimizer):
        name = getattr(optimizer, "__name__", "")
        return f"the function {name} that makes one (call it: {name}(learning_rate))"
    return f"{type(optimizer).__name__} {optimizer!r}"[:120]
