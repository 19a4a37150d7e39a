"""Losses of one micro-batch: `loss(outputs, targets)` returns the mean over it."""

import jax.numpy as jnp
import optax

from pipejax.errors import BatchError


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Mean softmax cross-entropy with integer labels."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def mse(outputs: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error over every element."""
    return jnp.mean(jnp.square(outputs - targets))


def next_token(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean cross-entropy of a language model over every position of every
    sequence: `logits` [B, T, vocab] predict the int `targets` [B, T] (the
    inputs shifted by one token). In nats; bits per token = nats / ln 2.
    Computed in float32 whatever the compute dtype."""
    if logits.ndim < 2 or logits.shape[:-1] != targets.shape:
        raise BatchError(f"next_token: logits {list(logits.shape)} need targets "
                         f"{list(logits.shape[:-1])} (one int token per position), not "
                         f"{list(targets.shape)}; give pj.pipeline(targets=...) one micro-batch "
                         "of token windows shifted by one")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise BatchError(f"next_token: targets have dtype {targets.dtype}; they are int token ids")
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets))
