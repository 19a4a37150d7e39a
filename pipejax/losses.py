"""Losses of one micro-batch: `loss(outputs, targets)` returns the mean over it."""

import jax.numpy as jnp
import optax


def cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Mean softmax cross-entropy with integer labels."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def mse(outputs: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error over every element."""
    return jnp.mean(jnp.square(outputs - targets))
