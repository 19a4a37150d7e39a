"""The models `--model` names: the zoo's (`pj.models.MODELS`, each with its
builder arguments and training settings), or your own function by import
path (cli/imports.py); and the layer list of either for a task's examples."""

from __future__ import annotations

from typing import Any

from pipejax.cli.imports import call_model, defaults, imported, is_import_path, parameters
from pipejax.models.zoo import MODELS, ZooModel

# What a flag left out means when the model's defaults do not say.
FLAG_DEFAULTS = {"lr_schedule": "constant", "warmup": 0, "eval_every": 0}
# Your own model's training settings, by what its data trains: the GPT's on
# a text corpus, the MLP's on classes; its context when --model-args gives none.
OWN_DEFAULTS = {"text": MODELS["gpt"].training, "classes": MODELS["mlp"].training}
CONTEXT = 128


def zoo(name: str) -> ZooModel | None:
    """The zoo's model `name`, None for your own (an import path)."""
    return None if is_import_path(name) else MODELS[name]


def check_model(name: str) -> None:
    """A zoo name or a `package.module:function` (imported here).

    Raises:
      ConfigError: neither.
    """
    import pipejax as pj

    if is_import_path(name):
        imported(name, "--model")
    elif name not in MODELS:
        raise pj.errors.ConfigError(
            f"--model {name!r}: not a model of the zoo ({', '.join(sorted(MODELS))}) nor "
            "the import path of your own, package.module:function (a function that returns "
            "the layer list)")


def training_defaults(name: str, text: bool) -> dict:
    """The training settings a model's flags default to (`text`: its data
    is a text corpus)."""
    model = zoo(name)
    return dict(model.training if model else OWN_DEFAULTS["text" if text else "classes"])


def model_kwargs(name: str, text: str | None = None) -> dict:
    """The model's builder arguments: its defaults, overridden by --model-args
    `text` ("depth=2,width=64,tie_embeddings=true": each value read as the
    type of the argument's default where it has one; else a number, true,
    false, none or a word).

    Raises:
      ConfigError: naming an argument the builder does not take or one the
        CLI sets from the data, a pair that is not KEY=VALUE, or a value that
        is not of its default's type.
    """
    import pipejax as pj

    model = zoo(name)
    own = model is None
    kwargs = {} if own else dict(model.arguments)
    builder = imported(name, "--model") if own else model.build
    names, anything = parameters(builder)
    known = [p for p in names if p not in _SET_BY_CLI]
    typed = defaults(builder)
    for pair in filter(None, (text or "").split(",")):
        key, eq, value = (part.strip() for part in pair.partition("="))
        if key in _SET_BY_CLI and key in names:
            raise pj.errors.ConfigError(f"--model-args {text!r}: {key!r} is set from "
                                        f"{_SET_BY_CLI[key]}, not --model-args")
        if not eq or (key not in known and not anything):
            raise pj.errors.ConfigError(
                f"--model-args {text!r}: {pair!r} is not KEY=VALUE of an argument of "
                f"{name if own else 'pj.models.' + name} ({', '.join(known)})")
        kwargs[key] = _value(value, typed.get(key), f"--model-args {text!r}: {key}")
    return kwargs


# Builder arguments the CLI passes itself, and what sets them.
_SET_BY_CLI = {"api": "--api", "inputs": "the data (one example's shape)",
               "rngs": "--seed (an nnx.Rngs)", "classes": "the data (its classes)",
               "vocab": "the data (the corpus's vocabulary)"}
_WORDS = {"true": True, "false": False, "none": None}


def _value(word: str, default: Any, where: str) -> Any:
    """`word` read as the type of `default` (a bool, an int, a float), or,
    with no such default, as a number, true, false, none or itself.

    Raises:
      ConfigError: `word` is not of `default`'s type (`where` names it).
    """
    from pipejax.errors import ConfigError

    if isinstance(default, str):
        return word
    value = _WORDS.get(word.lower(), word)
    if isinstance(value, str):
        try:
            value = int(word) if word.lstrip("-").isdigit() else float(word)
        except ValueError:
            pass
    if isinstance(default, bool) and value in (0, 1):
        return bool(value)
    kinds = {bool: (bool,), int: (int,), float: (int, float)}
    wanted = next((k for k in kinds if type(default) is k), None)
    if wanted and (type(value) not in kinds[wanted]):
        raise ConfigError(f"{where} takes {'a' if wanted is not int else 'an'} "
                          f"{wanted.__name__} (its default is {default!r}), not {word!r}")
    return float(value) if wanted is float else value


def api_of(layers) -> str:
    """The Flax API of a pipeline's (wrapped) layers: "nnx" where one is an
    NNX module, else "linen" (what --api builds for the zoo; your own
    function decides its own)."""
    from pipejax.layers.nnx import NnxLayer

    return "nnx" if any(isinstance(layer, NnxLayer) for layer in layers) else "linen"


def build_layers(name: str, example_shape: tuple, classes: int, api: str = "linen",
                 seed: int = 0, kwargs: dict | None = None) -> list:
    """The named model for examples of `example_shape` (signals [L] or images
    [H, W, C]), in Flax linen or NNX (built from nnx.Rngs(seed)); a language
    model over `classes` tokens (`example_shape` ()). `kwargs`: the
    builder's arguments (default: `model_kwargs(name)`). Your own model's
    function decides its API (`api` unused) and takes `rngs` if it wants."""
    import numpy as np
    from flax import nnx

    from pipejax.models.common import flatten

    kwargs = model_kwargs(name) if kwargs is None else kwargs
    model = zoo(name)
    if model is None:
        given = ({"vocab": classes, "context": kwargs.get("context", CONTEXT)} if not example_shape
                 else {"classes": classes, "inputs": tuple(example_shape)})
        return call_model(name, kwargs, {**given, "rngs": nnx.Rngs(seed)})
    if model.text:
        return model.build(**kwargs, vocab=classes, **(
            {"api": "nnx", "rngs": nnx.Rngs(seed)} if api == "nnx" else {}))
    image = len(example_shape) == 3
    needs_flat = model.flat == "always" or (image and model.flat == "images")
    if model.dims:
        kwargs = {**kwargs, "dims": 2 if image else 1}
    inputs = (int(np.prod(example_shape)),) if needs_flat else tuple(example_shape)
    if api == "nnx":
        kwargs = {**kwargs, "api": "nnx", "inputs": inputs, "rngs": nnx.Rngs(seed)}
    layers = model.build(**kwargs, classes=classes)
    return [flatten] + layers if needs_flat else layers
