"""What `pipejax train` trains on: a classification data set or a text corpus.

A task gives the training job what differs between the two: the loss, one
micro-batch of inputs and targets to trace with, the batches of each step,
the evaluation (test accuracy; validation loss and bits per byte) and its
headline, and the throughput's unit (examples or tokens per second). The job
itself (cli/train.py) is the same loop for both.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import jax.numpy as jnp

from pipejax.cli.imports import is_import_path, load_data
from pipejax.cli.models import CONTEXT, zoo
from pipejax.models import MODELS

TEXT = ("shakespeare",)  # the text corpora --data names
LANGUAGE_MODELS = tuple(name for name, model in MODELS.items() if model.text)


def default_data(model: str) -> str:
    """What --data a model trains on when none is given (your own: MNIST-1D)."""
    zoo_model = zoo(model)
    return zoo_model.data if zoo_model else "mnist1d"


def is_text(data: str) -> bool:
    """Whether --data names a text corpus (a language model's data)."""
    import pipejax as pj

    return data in TEXT or (is_import_path(data) and isinstance(load_data(data), pj.data.Corpus))


def load_task(model: str, data: str, context: int | None, eval_windows: int,
              seed: int) -> "Classification | LanguageModel":
    """The task of `--model` on `--data`, checked once (`pj.data.check`): a
    zoo model on the other kind of data (a language model on MNIST-1D) is an
    error; your own model trains what its data is (cli/imports.py)."""
    import pipejax as pj

    text = is_text(data)
    zoo_model = zoo(model)
    if zoo_model and zoo_model.text != text:
        want = f"a text corpus ({', '.join(TEXT)})" if zoo_model.text else (
            f"a classification data set (mnist1d, digits or a .npz file; the language models "
            f"{', '.join(LANGUAGE_MODELS)} train on text)")
        raise pj.errors.ConfigError(f"--model {model} trains on {want}, not --data {data}")
    loaded = (load_data(data) if is_import_path(data) else
              pj.data.shakespeare() if text else pj.data.load(data))
    pj.data.check(loaded, f"--data {data}")
    if text:
        return LanguageModel(loaded, context or CONTEXT, eval_windows, seed)
    return Classification(loaded, seed)


class Classification:
    """Classes of a `pj.data.Dataset`: cross-entropy, shuffled epochs, test accuracy."""

    unit = "examples"
    metric = "test_accuracy"

    def __init__(self, data, seed: int):
        import pipejax as pj

        self.data, self.seed = data, seed
        self.example_shape = data.x_train.shape[1:]
        self.classes = data.classes
        self.loss = pj.losses.cross_entropy
        self._accuracy: Callable | None = None

    def example(self, mb: int) -> tuple[Any, Any]:
        """One micro-batch of inputs and targets, as the pipeline traces them."""
        return jnp.zeros((mb, *self.example_shape), jnp.float32), None

    def steps_per_epoch(self, batch: int) -> int:
        return len(self.data.x_train) // batch

    def items(self, batch: int) -> int:
        """What one step consumes, in `unit`."""
        return batch

    def batches(self, batch: int, step: int) -> Iterator[tuple[int, tuple]]:
        """(epoch, batch) from step `step` on: shuffled epochs, fixed by the seed."""
        import pipejax as pj

        epoch, skip = divmod(step, self.steps_per_epoch(batch))
        while True:
            for xy in pj.data.batches(self.data.x_train, self.data.y_train, batch, self.seed,
                                      epoch):
                if skip:
                    skip -= 1
                    continue
                yield epoch, xy
            epoch += 1

    def bind(self, layers) -> None:
        import pipejax as pj

        self._accuracy = pj.evaluator(layers)

    def evaluate(self, variables, final: bool = False) -> dict:
        d = self.data
        out = {"test_accuracy": self._accuracy(variables, d.x_test, d.y_test)}
        if final:
            out["train_accuracy"] = self._accuracy(variables, d.x_train, d.y_train)
        return out

    @staticmethod
    def describe(metrics: dict) -> str:
        return f"test accuracy {100 * metrics['test_accuracy']:.2f}%"

    @staticmethod
    def lines(summary: dict) -> list[tuple[str, str]]:
        return [("test accuracy", f"{100 * summary['test_accuracy']:.2f}%"),
                ("train accuracy", f"{100 * summary['train_accuracy']:.2f}%")]


class LanguageModel:
    """Next-token prediction on a `pj.data.Corpus` of byte tokens: random
    windows of `context + 1` tokens a step, fixed by (seed, step); the
    validation loss in nats per token and in bits per byte (nats / ln 2, a
    token being a byte) over consecutive validation windows: `eval_windows`
    of them spread over the text during training, all of them at the end."""

    unit = "tokens"
    metric = "validation_loss"

    def __init__(self, corpus, context: int, eval_windows: int, seed: int):
        import pipejax as pj

        self.corpus, self.context, self.seed = corpus, context, seed
        self.eval_windows = eval_windows
        self.classes = corpus.vocab
        self.loss = pj.losses.next_token
        self._loss: Callable | None = None

    def example(self, mb: int) -> tuple[Any, Any]:
        tokens = jnp.zeros((mb, self.context), jnp.int32)
        return tokens, tokens

    def steps_per_epoch(self, batch: int) -> int:
        return max(len(self.corpus.train) // (batch * self.context), 1)

    def items(self, batch: int) -> int:
        return batch * self.context

    def batches(self, batch: int, step: int) -> Iterator[tuple[int, tuple]]:
        import pipejax as pj

        per_epoch = self.steps_per_epoch(batch)
        while True:
            yield step // per_epoch, pj.data.windows(self.corpus.train, batch, self.context,
                                                     self.seed, step)
            step += 1

    def bind(self, layers) -> None:
        import pipejax as pj

        self._loss = pj.loss_evaluator(layers, self.loss)

    def evaluate(self, variables, final: bool = False) -> dict:
        import pipejax as pj

        x, y = pj.data.evaluation_windows(self.corpus.validation, self.context,
                                          None if final else self.eval_windows)
        nats = self._loss(variables, x, y)
        return {"validation_loss": nats, "bits_per_byte": nats / math.log(2)}

    @staticmethod
    def describe(metrics: dict) -> str:
        return (f"validation loss {metrics['validation_loss']:.4f} nats, "
                f"{metrics['bits_per_byte']:.4f} bits per byte")

    @staticmethod
    def lines(summary: dict) -> list[tuple[str, str]]:
        return [("validation loss", f"{summary['validation_loss']:.4f} nats per token"),
                ("bits per byte", f"{summary['bits_per_byte']:.4f}")]

    def sample(self, layers, variables, prompt: str, length: int, seed: int,
               temperature: float) -> str:
        """The report's sample: `length` bytes after `prompt`."""
        return sample_text(layers, variables, prompt, length, self.context, seed, temperature)


def sample_text(layers, variables, prompt: str, length: int, context: int, seed: int,
                temperature: float, top_k: int | None = None) -> str:
    """`prompt` and the `length` bytes a language model writes after it, as text."""
    import jax

    import pipejax as pj

    tokens = pj.generate(layers, variables, pj.data.encode(prompt), length, context=context,
                         key=jax.random.key(seed), temperature=temperature, top_k=top_k)
    return prompt + pj.data.decode(tokens)
