"""Evaluating a trained layer list outside the pipeline: classification
accuracy, or the mean of a loss (a language model's validation loss)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.layers import Layer, Variables, apply_layers, layer_list


def evaluator(layers: Sequence[Layer], *,
              batch: int = 500) -> Callable[[Sequence[Variables], Any, Any], float]:
    """`accuracy(variables, x, y)`: the share of the examples `x` whose argmax
    prediction equals the integer label in `y`, the layers run with
    `train=False` on one variables dict per layer (`pj.unstage(state.params)`),
    `batch` examples at a time. The prediction is compiled once per `evaluator`.
    NNX modules run in `.eval()` mode on copies: `layers` are not written."""
    layers = layer_list(layers, [])  # tied weights: each layer runs on its own copy
    predict = jax.jit(lambda v, x: jnp.argmax(apply_layers(layers, v, x, train=False), -1))

    def accuracy(variables: Sequence[Variables], x: Any, y: Any) -> float:
        hits = sum(int(np.sum(np.asarray(predict(variables, x[i:i + batch])) == y[i:i + batch]))
                   for i in range(0, len(x), batch))
        return hits / len(x)

    return accuracy


def loss_evaluator(layers: Sequence[Layer], loss: Callable[[Any, Any], jax.Array], *,
                   batch: int = 64) -> Callable[[Sequence[Variables], Any, Any], float]:
    """`mean_loss(variables, x, y)`: `loss(outputs, targets)` averaged over the
    examples of `x` (each chunk of `batch` weighted by its size), the layers
    run with `train=False`; compiled once per chunk size. With
    `pj.losses.next_token` on `pj.data.evaluation_windows`, the validation
    loss in nats per token; over byte tokens, / ln 2 gives bits per byte."""
    layers = layer_list(layers, [])  # tied weights: each layer runs on its own copy
    chunk_loss = jax.jit(lambda v, x, y: loss(apply_layers(layers, v, x, train=False), y))

    def mean_loss(variables: Sequence[Variables], x: Any, y: Any) -> float:
        total = sum(float(chunk_loss(variables, x[i:i + batch], y[i:i + batch]))
                    * len(x[i:i + batch]) for i in range(0, len(x), batch))
        return total / len(x)

    return mean_loss
