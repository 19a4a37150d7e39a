"""One optax transformation per stage, from what a user passes as the optimizer.

`pipe.trainer(optimizer)` and `pj.simulate(..., optimizer)` take an optax
`GradientTransformation` (the same for every stage) or a function
`StageInfo -> GradientTransformation`, so that staleness-aware transforms
get their stage's delay and horizons. Anything else (a name, a class, an
optax function given uncalled) is refused here with what to pass instead,
before it can fail deep inside a compiled step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import optax

from pipejax.errors import OptimizerError
from pipejax.schedules import StageInfo
from pipejax.transforms.recipes import Mitigation

Optimizer = Any  # optax.GradientTransformation | Callable[[StageInfo], GradientTransformation]

_KINDS = ("the optimizer must be an optax GradientTransformation such as optax.adam(1e-3), or "
          "a function StageInfo -> GradientTransformation")


def per_stage(optimizer: Optimizer, infos: Sequence[StageInfo],
              caller: str = "the optimizer argument") -> tuple[optax.GradientTransformation, ...]:
    """The transformation of every stage of `infos`; a clear error, naming
    `caller` (e.g. "pipe.trainer"), for anything else."""
    if isinstance(optimizer, optax.GradientTransformation):
        return (optimizer,) * len(infos)
    _check_kind(optimizer, caller)
    transforms = tuple(_call(optimizer, info, caller) for info in infos)
    bad = [k for k, t in enumerate(transforms) if not isinstance(t, optax.GradientTransformation)]
    if bad:
        raise OptimizerError(
            f"{caller}: the optimizer function returned {type(transforms[bad[0]]).__name__} for "
            f"stage {bad[0]}; it must return an optax GradientTransformation for every StageInfo")
    return transforms


def _check_kind(optimizer: Any, caller: str) -> None:
    """Raise unless `optimizer` may be a function StageInfo -> transformation.
    An optax factory such as `optax.adam` would accept a StageInfo as its
    learning rate and fail only inside the step, so a function of optax, or
    any function whose first parameter is a required `learning_rate`, is
    taken for a factory given uncalled."""
    if isinstance(optimizer, Mitigation):
        raise OptimizerError(f"{caller} got a pj.transforms.Mitigation; pass its .optimizer "
                                "(and build the pipeline with "
                                "weight_stashing=mitigation.weight_stashing)")
    if isinstance(optimizer, type):
        raise OptimizerError(f"{caller} got the class {optimizer.__name__} (pass an instance, "
                                f"not the class): {_KINDS}")
    if not callable(optimizer):
        named = isinstance(optimizer, str) and callable(getattr(optax, optimizer, None))
        raise OptimizerError(f"{caller} got {type(optimizer).__name__} {optimizer!r:.60}: "
                                + (f"pass optax.{optimizer}(1e-3); " if named else "") + _KINDS)
    if _takes_learning_rate(optimizer):
        inner = _unwrapped(optimizer)
        name, short = _name(optimizer), getattr(inner, "__name__", "")
        if isinstance(optimizer, functools.partial) or hasattr(inner, "__wrapped__"):
            # a partial, or a wrapper such as optax.inject_hyperparams(optax.adam)
            name = name if inner is not optimizer else f"a wrapper of {name}"
            call = " with its hyper-parameters, e.g. f(learning_rate=1e-3) for the f you passed"
        else:
            call = f", {name}(learning_rate), e.g. {name}(1e-3)"
        raise OptimizerError(f"{caller} got the function {short} that makes one transform "
                             f"({name}), not the transform itself: call it{call}")
    if _module(optimizer) == "optax":
        raise OptimizerError(f"{caller} got the optax function {_name(optimizer)}: {_KINDS}")


def _call(optimizer: Callable, info: StageInfo, caller: str) -> Any:
    """`optimizer(info)`, a TypeError of the call turned into what to pass."""
    try:
        return optimizer(info)
    except TypeError as e:
        raise OptimizerError(
            f"{caller}: calling the optimizer function with {info} failed ({e}); "
            f"{_KINDS}, not a function that makes one from other arguments") from e


def _unwrapped(fn: Callable) -> Callable:
    """The function a `functools.partial` calls."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _module(fn: Callable) -> str:
    """The top-level package `fn` comes from ("optax", "__main__", ...)."""
    return (getattr(_unwrapped(fn), "__module__", None) or "").split(".")[0]


def _name(fn: Callable) -> str:
    """`optax.adam` for what optax exports, else the module and qualified name."""
    inner = _unwrapped(fn)
    name = getattr(inner, "__name__", type(inner).__name__)
    if _module(inner) == "optax" and callable(getattr(optax, name, None)):
        name = f"optax.{name}"
    elif hasattr(inner, "__qualname__"):
        name = f"{inner.__module__}.{inner.__qualname__}"
    return f"functools.partial({name}, ...)" if inner is not fn else name


def _takes_learning_rate(fn: Callable) -> bool:
    """Whether the first positional parameter of `fn` is a required
    `learning_rate`: optax's convention for a function that makes an optimizer."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(positional) and positional[0].name == "learning_rate" \
        and positional[0].default is inspect.Parameter.empty
