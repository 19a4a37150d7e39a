"""Token sequences of several lengths as language-model batches: padded up to
the next of a few lengths, or packed several to a row with document ids.

A sequence of n tokens gives n − 1 positions: inputs `s[:-1]`, next-token
targets `s[1:]`. `pad_to_lengths` pads every sequence of a batch to the
shortest of the lengths the user names that holds the longest, so a
pipeline compiles one program per length (`pj.pipeline(max_shapes=...)`)
instead of one per batch; `pack_documents` fills rows of one length with
whole documents, each with its own id, which the zoo GPT reads to keep
attention and positions inside a document (torchtitan's and MaxText's
packing). Both give targets `(tokens, mask)`, the mask false where a
position holds no token: `pj.losses.next_token` averages over the rest. A
causal model needs no attention mask for padding at the end of a row: no
real position attends to a later one.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from pipejax.errors import DataError


class Sequences(NamedTuple):
    """A batch of token rows: `inputs` (tokens [B, T] int32, or with document
    ids the pair (tokens, segments)) and `targets` (next tokens [B, T], mask
    [B, T] bool); `batch` is `(inputs, targets)`."""

    inputs: Any
    targets: tuple[np.ndarray, np.ndarray]

    @property
    def batch(self) -> tuple:
        return self.inputs, self.targets

    @property
    def padding(self) -> float:
        """The fraction of positions that hold no token (padding)."""
        return float(1.0 - self.targets[1].mean())


def _arrays(sequences: Sequence[Any], what: str) -> list[np.ndarray]:
    """Each sequence as a 1-D int array of at least two tokens."""
    if len(sequences) == 0:
        raise DataError(f"{what}: no sequences given")
    out = []
    for i, s in enumerate(sequences):
        a = np.asarray(s)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise DataError(f"{what}: sequence {i} is {a.dtype}{list(a.shape)}; give 1-D int "
                            "token arrays")
        if len(a) < 2:
            raise DataError(f"{what}: sequence {i} holds {len(a)} token(s); a sequence needs two "
                            "or more (an input and its next token)")
        out.append(a)
    return out


def pad_to_lengths(sequences: Sequence[Any], lengths: Sequence[int], pad: int = 0) -> Sequences:
    """Every sequence's n − 1 positions in a row of T, the shortest of
    `lengths` that holds the longest sequence; inputs and targets past a
    sequence's end are `pad` and masked out."""
    seqs = _arrays(sequences, "pad_to_lengths")
    need = max(len(s) for s in seqs) - 1
    fits = sorted(n for n in lengths if n >= need)
    if not fits:
        longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
        raise DataError(f"pad_to_lengths: sequence {longest} of {need + 1} tokens needs {need} "
                        f"positions, more than the longest of lengths {sorted(lengths)}; cut it "
                        f"into windows (pj.data.windows) or add a length >= {need}")
    T = fits[0]
    tokens = np.full((len(seqs), T + 1), pad, np.int32)
    mask = np.zeros((len(seqs), T), bool)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
        mask[i, :len(s) - 1] = True
    return Sequences(tokens[:, :-1], (tokens[:, 1:], mask))


def pack_documents(documents: Sequence[Any], length: int, rows: int | None = None,
                   pad: int = 0) -> Sequences:
    """Documents packed in order into rows of `length` positions, a new row
    when the next does not fit; inputs `(tokens, segments)`, segment ids 1, 2,
    ... within a row (0: padding). A document longer than a row is cut into
    pieces of `length` + 1 tokens, overlapping by one, each its own document
    (its positions start again). `rows`: exactly that many rows (more
    documents than fit are an error; fewer leave rows of padding)."""
    docs = _arrays(documents, "pack_documents")
    pieces = [d[i:i + length + 1] for d in docs for i in range(0, len(d) - 1, length)]
    pieces = [p for p in pieces if len(p) >= 2]
    placed: list[list[np.ndarray]] = [[]]
    used = 0
    for p in pieces:
        if used + len(p) - 1 > length:
            placed.append([])
            used = 0
        placed[-1].append(p)
        used += len(p) - 1
    if rows is not None and len(placed) > rows:
        raise DataError(f"pack_documents: the documents fill {len(placed)} rows of {length} "
                        f"positions, more than rows={rows}; give fewer documents or more rows")
    n = len(placed) if rows is None else rows
    inputs, targets = np.full((n, length), pad, np.int32), np.full((n, length), pad, np.int32)
    segments, mask = np.zeros((n, length), np.int32), np.zeros((n, length), bool)
    for r, row in enumerate(placed):
        at = 0
        for doc, p in enumerate(row, start=1):
            span = slice(at, at + len(p) - 1)
            inputs[r, span], targets[r, span] = p[:-1], p[1:]
            segments[r, span], mask[r, span] = doc, True
            at += len(p) - 1
    return Sequences((inputs, segments), (targets, mask))
