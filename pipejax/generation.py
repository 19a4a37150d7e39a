"""Text from a trained language model's layer list, on one device.

Generation does not need the pipeline: the layers run in sequence under
`jit` on the last `context` tokens (no cache of keys and values), and the
next token is drawn from the softmax of the last position's logits at a
temperature. A causal model's logits at position t do not depend on what
follows t, so each step runs on one fixed-size window (the tokens so far,
padded) and one program serves the whole generation.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.errors import ConfigError
from pipejax.layers import Layer, Variables, apply_layers, layer_list


def generate(layers: Sequence[Layer], variables: Sequence[Variables], prompt: Any, length: int,
             *, context: int, key: jax.Array, temperature: float = 1.0,
             top_k: int | None = None) -> np.ndarray:
    """`length` tokens that follow the int tokens `prompt` ([n], n ≥ 1).

    Args:
      layers, variables: the model and one variables entry per layer (`pj.unstage`).
      context: the longest input the model takes (its position embedding).
      key: draws the tokens; the same key gives the same text.
      temperature: divides the logits; 0 picks the most likely token.
      top_k: draw among the `top_k` most likely tokens only.
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if len(prompt) < 1 or length < 0 or context < 1 or temperature < 0:
        raise ConfigError(f"generate: prompt of {len(prompt)} tokens, length {length}, context "
                          f"{context}, temperature {temperature}; give at least one prompt "
                          "token, length ≥ 0, context ≥ 1 and temperature ≥ 0")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"generate: top_k={top_k}; draw among 1 or more tokens, or give None")
    layers, n = layer_list(layers), len(prompt)
    tokens = jnp.zeros((n + length,), jnp.int32).at[:n].set(prompt)

    def next_token(carry, step_key):
        tokens, t = carry  # t tokens so far; the window is the last ≤ context of them
        start = jnp.maximum(t - context, 0)
        window = jax.lax.dynamic_slice(tokens, (start,), (min(context, n + length),))
        logits = apply_layers(layers, variables, window[None], train=False)[0]
        logits = logits[jnp.minimum(t, context) - 1].astype(jnp.float32)
        if top_k is not None and top_k < logits.shape[-1]:
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        token = (jnp.argmax(logits) if temperature == 0 else
                 jax.random.categorical(step_key, logits / temperature)).astype(jnp.int32)
        return (tokens.at[t].set(token), t + 1), None

    run = jax.jit(lambda tokens, keys: jax.lax.scan(next_token, (tokens, n), keys)[0][0])
    return np.asarray(run(tokens, jax.random.split(key, length)))[n:]
