"""The zoo by name: each model's builder arguments and training settings,
and its layer list for a task's examples."""

from __future__ import annotations

# Per model: keyword arguments of its builder and the training settings that
# reach the accuracies of docs/training-job.md on MNIST-1D (4 stages, GPipe); the GPT's
# reach the validation loss of docs/language-models.md on Shakespeare's works.
MODEL_DEFAULTS = {
    "mlp": ({"depth": 4, "width": 256}, {"lr": 1e-3, "epochs": 60}),
    "snn": ({"depth": 16, "width": 128}, {"lr": 3e-4, "epochs": 40}),
    "resnet": ({"depth": 6, "width": 32, "groups": 8}, {"lr": 3e-3, "epochs": 15}),
    "vgg": ({}, {"lr": 1e-3, "epochs": 30}),
    "transformer": ({"layers": 4, "dim": 64, "heads": 4}, {"lr": 1e-3, "epochs": 40}),
    "residual_lstm": ({"layers": 3, "hidden": 64}, {"lr": 3e-3, "epochs": 15}),
    "gpt": ({"depth": 6, "width": 128, "heads": 4, "context": 128},
            {"lr": 2e-3, "steps": 2000, "optimizer": "adamw", "lr_schedule": "cosine",
             "warmup": 100, "batch_size": 32, "eval_every": 250}),
}
# What a flag left out means when the model's defaults do not say.
FLAG_DEFAULTS = {"lr_schedule": "constant", "warmup": 0, "eval_every": 0}


def model_kwargs(name: str, text: str | None = None) -> dict:
    """The model's builder arguments: its defaults, overridden by --model-args
    `text` ("depth=2,width=64": numbers, or words for string arguments).

    Raises:
      ConfigError: naming an argument the builder does not take, or a pair
        that is not KEY=VALUE.
    """
    import inspect

    import pipejax as pj

    kwargs = dict(MODEL_DEFAULTS[name][0])
    known = [p for p in inspect.signature(pj.models.MODELS[name]).parameters
             if p not in ("api", "inputs", "rngs", "classes", "vocab")]
    for pair in filter(None, (text or "").split(",")):
        key, eq, value = pair.partition("=")
        if not eq or key.strip() not in known:
            raise pj.errors.ConfigError(
                f"--model-args {text!r}: {pair!r} is not KEY=VALUE of an argument of "
                f"pj.models.{name} ({', '.join(known)})")
        try:
            kwargs[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            kwargs[key.strip()] = value.strip()
    return kwargs


def build_layers(name: str, example_shape: tuple, classes: int, api: str = "linen",
                 seed: int = 0, kwargs: dict | None = None) -> list:
    """The named model for examples of `example_shape` (signals [L] or images
    [H, W, C]), in Flax linen or NNX (built from nnx.Rngs(seed)); a language
    model over `classes` tokens. `kwargs`: the builder's arguments
    (default: `model_kwargs(name)`)."""
    import numpy as np
    from flax import nnx

    import pipejax as pj
    from pipejax.models.common import flatten

    kwargs = model_kwargs(name) if kwargs is None else kwargs
    if name == "gpt":
        return pj.models.gpt(**kwargs, vocab=classes, **(
            {"api": "nnx", "rngs": nnx.Rngs(seed)} if api == "nnx" else {}))
    image = len(example_shape) == 3
    # The MLP, and the sequence models on images, read flat vectors (the SNN flattens itself).
    needs_flat = name == "mlp" or (image and name != "snn")
    if name in ("resnet", "vgg"):
        kwargs, needs_flat = {**kwargs, "dims": 2 if image else 1}, False
    inputs = (int(np.prod(example_shape)),) if needs_flat else tuple(example_shape)
    if api == "nnx":
        kwargs = {**kwargs, "api": "nnx", "inputs": inputs, "rngs": nnx.Rngs(seed)}
    layers = pj.models.MODELS[name](**kwargs, classes=classes)
    return [flatten] + layers if needs_flat else layers
