"""Text as byte tokens, and the windows a language model trains on.

A `Corpus` holds a training and a validation text as uint8 token arrays
(vocabulary 256: one token a byte of UTF-8). `windows` draws a batch of
random windows of `context + 1` tokens, inputs and next-token targets, in
an order fixed by (seed, step); `evaluation_windows` cuts a text into
consecutive windows, the same ones at every call, for a validation loss that
can be compared across steps and runs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipejax.errors import DataError

VOCAB = 256  # byte tokens


class Corpus(NamedTuple):
    """Training and validation text as uint8 byte tokens, and the documents of each."""

    train: np.ndarray
    validation: np.ndarray
    train_documents: tuple[str, ...]
    validation_documents: tuple[str, ...]

    @property
    def vocab(self) -> int:
        return VOCAB


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of `text` as uint8 tokens."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).copy()


def decode(tokens) -> str:
    """Tokens back to text; bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


def _check(tokens: np.ndarray, context: int, what: str) -> None:
    if context < 1:
        raise DataError(f"{what}: context {context} must be at least 1 token")
    if len(tokens) < context + 1:
        raise DataError(f"{what}: a text of {len(tokens)} tokens holds no window of "
                        f"context + 1 = {context + 1} tokens; use a smaller context")


def windows(tokens: np.ndarray, batch: int, context: int, seed: int,
            step: int) -> tuple[np.ndarray, np.ndarray]:
    """`batch` windows at random offsets fixed by (seed, step): int32 inputs
    [batch, context] and targets [batch, context], the inputs shifted by one."""
    _check(tokens, context, "windows")
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - context, batch)
    return _cut(tokens, starts, context)


def evaluation_windows(tokens: np.ndarray, context: int,
                       count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive windows of `context + 1` tokens, overlapping by one so that
    each token they cover but the first is a target once (a last part shorter
    than a window is left out): all of them, or `count` spread evenly over the
    text. Deterministic: a validation set."""
    _check(tokens, context, "evaluation_windows")
    starts = np.arange(0, len(tokens) - context, context)
    if count is not None and count < len(starts):
        starts = starts[np.linspace(0, len(starts) - 1, count).round().astype(int)]
    return _cut(tokens, starts, context)


def _cut(tokens: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    block = tokens[starts[:, None] + np.arange(context + 1)].astype(np.int32)
    return block[:, :-1], block[:, 1:]
