"""The zoo: each model's name, builder and the settings it trains with, in
one registry, as the schedule families are in theirs.

A `ZooModel` carries what everything else would otherwise read off its
name: the builder's arguments the command line gives it, the training
settings that reach the figures of docs/training-job.md (4 stages, GPipe,
MNIST-1D) and, for the GPT, of docs/language-models.md (Shakespeare's
works), whether it is a language model (text, built over the corpus's
vocabulary), and how it reads a classification example (flat vectors or
signals and images as they are). `pipejax train --model NAME` and
`pipejax plan` read `MODELS`; nothing in the CLI compares a model's name.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Literal, Mapping

from pipejax.models.gpt import gpt, gpt_muon_dimensions
from pipejax.models.mlp import mlp
from pipejax.models.residual_lstm import residual_lstm
from pipejax.models.resnet import resnet
from pipejax.models.snn import snn
from pipejax.models.transformer import transformer
from pipejax.models.vgg import vgg


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A model of the zoo.

    Attributes:
      build: the builder (`pj.models.mlp`, ...): layers from keyword arguments.
      arguments: the builder's arguments the command line gives by default.
      training: the training flags it defaults to (lr, epochs or steps, ...).
      text: a language model: it trains on a text corpus and is built over
        its vocabulary (`vocab`); otherwise a classifier of `classes`.
      flat: which examples it reads as flat vectors: "always" (the MLP),
        "images" (a sequence model reads an image's pixels in order),
        "never" (it takes signals and images as they are).
      dims: it takes `dims`, the example's spatial dimensions (1 for
        signals, 2 for images).
      muon: Muon's axes of its matrices (`pj.transforms.Muon(dimensions=)`);
        None: optax's default, every 2-D leaf.
    """

    build: Callable[..., list]
    arguments: Mapping[str, Any]
    training: Mapping[str, Any]
    text: bool = False
    flat: Literal["always", "images", "never"] = "never"
    dims: bool = False
    muon: Callable | None = None

    @property
    def data(self) -> str:
        """The data it trains on when none is given."""
        return "shakespeare" if self.text else "mnist1d"


MODELS: Mapping[str, ZooModel] = types.MappingProxyType({
    "mlp": ZooModel(mlp, {"depth": 4, "width": 256}, {"lr": 1e-3, "epochs": 60}, flat="always"),
    "snn": ZooModel(snn, {"depth": 16, "width": 128}, {"lr": 3e-4, "epochs": 40}),
    "resnet": ZooModel(resnet, {"depth": 6, "width": 32, "groups": 8},
                       {"lr": 3e-3, "epochs": 15}, dims=True),
    "vgg": ZooModel(vgg, {}, {"lr": 1e-3, "epochs": 30}, dims=True),
    "transformer": ZooModel(transformer, {"layers": 4, "dim": 64, "heads": 4},
                            {"lr": 1e-3, "epochs": 40}, flat="images"),
    "residual_lstm": ZooModel(residual_lstm, {"layers": 3, "hidden": 64},
                              {"lr": 3e-3, "epochs": 15}, flat="images"),
    "gpt": ZooModel(gpt, {"depth": 6, "width": 128, "heads": 4, "context": 128},
                    {"lr": 2e-3, "steps": 2000, "optimizer": "adamw", "lr_schedule": "cosine",
                     "warmup": 100, "batch_size": 32, "eval_every": 250}, text=True,
                    muon=gpt_muon_dimensions),
})
