"""Losses of one micro-batch: `loss(outputs, targets)` returns the mean over it."""

from typing import Any

import jax.numpy as jnp
import optax

from pipejax.errors import BatchError


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Mean softmax cross-entropy with integer labels."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def mse(outputs: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error over every element."""
    return jnp.mean(jnp.square(outputs - targets))


def next_token(logits: jnp.ndarray, targets: Any, mask: jnp.ndarray | None = None
               ) -> jnp.ndarray:
    """Mean cross-entropy of a language model over the positions of one
    micro-batch: `logits` [B, T, vocab] predict the int `targets` [B, T] (the
    inputs shifted by one token). In nats; bits per token = nats / ln 2.
    Computed in float32 whatever the compute dtype.

    With a `mask` [B, T] (bool, or weights), or `targets` given as a pair
    `(tokens, mask)` (what `pj.data.pad_to_lengths` and `pj.data.pack_documents`
    make), the mean runs over the masked-in positions only: padding and the
    positions whose next token belongs to another document add nothing. The
    mean is per micro-batch, as Megatron-LM's default: a step's loss is the
    mean of its M micro-batches' (GPipe), so each micro-batch counts alike
    however many of its tokens are real. A micro-batch with none gives 0."""
    if isinstance(targets, (tuple, list)):
        if mask is not None or len(targets) != 2:
            raise BatchError(f"next_token: targets as a pair are (tokens, mask); got "
                             f"{len(targets)} parts" + (" and a mask" if mask is not None else ""))
        targets, mask = targets
    if logits.ndim < 2 or logits.shape[:-1] != targets.shape:
        raise BatchError(f"next_token: logits {list(logits.shape)} need targets "
                         f"{list(logits.shape[:-1])} (one int token per position), not "
                         f"{list(targets.shape)}; give pj.pipeline(targets=...) one micro-batch "
                         "of token windows shifted by one")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise BatchError(f"next_token: targets have dtype {targets.dtype}; they are int token ids")
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return jnp.mean(losses)
    if jnp.shape(mask) != targets.shape:
        raise BatchError(f"next_token: a mask {list(jnp.shape(mask))} for targets "
                         f"{list(targets.shape)}; give one weight per position")
    mask = jnp.asarray(mask, jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)
