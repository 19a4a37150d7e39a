"""Your own model and data in the CLI, by import path:
`--model package.module:function` and `--data package.module:function`.

A module is found as `python -m` finds it, the current directory first, so
`pipejax train --model mymodels:llama` works from the folder that holds
`mymodels.py` under the `pipejax` script too (whose own folder is the one a
script would search). The model's function is called with `--model-args` as
keywords, and with what the data decides when it names them: `vocab` and
`context` for a text corpus, `classes` and `inputs` (one example's shape)
for a classification set, `rngs` (an `nnx.Rngs` of the run's seed) for NNX
layers; it returns the layer list. The data's function returns a
`pj.data.Corpus` (next-token training) or a `pj.data.Dataset` (classes).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable

from pipejax.errors import ConfigError

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_import_path(text: str) -> bool:
    """Whether `text` reads `package.module:function`."""
    return bool(_PATH.match(text))


def imported(spec: str, flag: str) -> Callable:
    """The callable `spec` (`package.module:function`) names; `flag` for the errors.

    Raises:
      ConfigError: the module cannot be imported, has no such name, or the
        name is not callable.
    """
    module, _, name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{flag} {spec}: cannot import {module} ({e}); run from the folder that "
                          f"holds {module.split('.')[0]}, or add that folder to PYTHONPATH") from e
    fn = getattr(found, name, None)
    if fn is None:
        public = [n for n, v in vars(found).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(f"{flag} {spec}: {module} ({found.__file__}) has no {name!r}; its "
                          f"functions: {', '.join(sorted(public)) or 'none'}")
    if not callable(fn):
        raise ConfigError(f"{flag} {spec}: {module}.{name} is a {type(fn).__name__}, not a "
                          "function")
    return fn


def parameters(fn: Callable) -> tuple[list[str], bool]:
    """`fn`'s keyword parameter names, and whether it takes any (**kwargs)."""
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def defaults(fn: Callable) -> dict[str, Any]:
    """`fn`'s keyword parameters that have a default, and that default."""
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.default is not p.empty}


def call_model(spec: str, kwargs: dict, given: dict[str, Any]) -> list:
    """The layer list of the function `spec` names, called with `kwargs`
    (--model-args) and those of `given` (what the data decides) it names.

    Raises:
      ConfigError: the call fails on its arguments, or returns no layer list.
    """
    fn = imported(spec, "--model")
    names, _ = parameters(fn)
    extra = {k: v for k, v in given.items() if k in names and k not in kwargs}
    try:
        layers = fn(**kwargs, **extra)
    except TypeError as e:
        raise ConfigError(f"--model {spec}: calling it with {sorted({**kwargs, **extra})} "
                          f"failed: {e}") from e
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ConfigError(f"--model {spec} returned {type(layers).__name__}"
                          f"{'' if layers else ' (empty)'}, not a list of layers (Flax modules "
                          "or functions, in order)")
    return list(layers)


@functools.lru_cache(maxsize=None)
def load_data(spec: str) -> Any:
    """What the function `spec` names returns: a `pj.data.Corpus` or a
    `pj.data.Dataset` (loaded once a process).

    Raises:
      ConfigError: it returns something else.
    """
    import pipejax as pj

    data = imported(spec, "--data")()
    if not isinstance(data, (pj.data.Corpus, pj.data.Dataset)):
        raise ConfigError(f"--data {spec} returned {type(data).__name__}, not a pj.data.Corpus "
                          "(a text corpus) or a pj.data.Dataset (a classification set)")
    return data
