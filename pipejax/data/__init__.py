"""Data sets: MNIST-1D (default), scikit-learn digits, user `.npz`, and text.

The classification sets need no download. Text is byte tokens in a `Corpus`
(data/text.py); Shakespeare's works (data/shakespeare.py) are fetched once
from the package index and cached.

MNIST-1D (Greydanus 2020) is generated offline by the `mnist1d` package from
its ten templates and cached under the user's cache directory; digits ship
with scikit-learn. Every loader returns a `Dataset` of float32 inputs and
int32 labels, and `batches` shuffles deterministically by seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from pipejax.errors import DataError
from pipejax.data.sequences import Sequences, pack_documents, pad_to_lengths
from pipejax.data.shakespeare import shakespeare
from pipejax.data.text import Corpus, decode, encode, evaluation_windows, windows


class Dataset(NamedTuple):
    """Train and test arrays; inputs float32, labels int32."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def cache_dir() -> Path:
    """`$PIPEJAX_CACHE`, else `$XDG_CACHE_HOME/pipejax`, else `~/.cache/pipejax`."""
    if os.environ.get("PIPEJAX_CACHE"):
        return Path(os.environ["PIPEJAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipejax"


def _dataset(x_train, y_train, x_test, y_test, source: str) -> Dataset:
    arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if np.ndim(y) != 1:
            raise DataError(f"{source}: y_{split} has shape {np.shape(y)}; labels must be 1-D integers")
        if len(x) != len(y):
            raise DataError(f"{source}: x_{split} holds {len(x)} examples but y_{split} holds "
                            f"{len(y)}; they must match")
        if not np.issubdtype(np.asarray(y).dtype, np.integer):
            raise DataError(f"{source}: y_{split} has dtype {np.asarray(y).dtype}; labels must be integers")
    if np.shape(x_train)[1:] != np.shape(x_test)[1:]:
        raise DataError(f"{source}: train examples have shape {np.shape(x_train)[1:]} but test "
                        f"examples {np.shape(x_test)[1:]}")
    return Dataset(np.asarray(x_train, np.float32), np.asarray(y_train, np.int32),
                   np.asarray(x_test, np.float32), np.asarray(y_test, np.int32))


def mnist1d(num_samples: int = 5000, train_split: float = 0.8, seed: int = 42,
            cache: bool = True) -> Dataset:
    """MNIST-1D: 40-sample 1-D signals of ten digit templates (default 4000/1000 split)."""
    from mnist1d.data import get_dataset_args, make_dataset
    from mnist1d.utils import ObjectView

    args = get_dataset_args(as_dict=True)
    args.update(num_samples=num_samples, train_split=train_split, seed=seed)
    tag = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"mnist1d-{tag}.npz"
    if cache and path.exists():
        return npz(path)
    data = make_dataset(ObjectView(args))
    out = _dataset(data["x"], data["y"], data["x_test"], data["y_test"], "mnist1d")
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **out._asdict())
        tmp.replace(path)
    return out


def digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's 8×8 digits as [N, 8, 8, 1] images scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0)[..., None]
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(test_fraction * len(x)))
    test, train = order[:n_test], order[n_test:]
    return _dataset(x[train], d.target[train], x[test], d.target[test], "digits")


def npz(path: str | os.PathLike) -> Dataset:
    """A user `.npz` file holding `x_train, y_train, x_test, y_test`."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    try:
        with np.load(path) as f:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f]
            if missing:
                raise DataError(f"{path} lacks arrays {missing}; it needs x_train, y_train, "
                                f"x_test, y_test (it has {sorted(f.files)})")
            return _dataset(f["x_train"], f["y_train"], f["x_test"], f["y_test"], str(path))
    except (OSError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path} is not a readable .npz file: {err}") from None


def load(name: str) -> Dataset:
    """'mnist1d', 'digits', or a path to a `.npz` file."""
    if name == "mnist1d":
        return mnist1d()
    if name == "digits":
        return digits()
    if name.endswith(".npz"):
        return npz(name)
    raise DataError(f"unknown data {name!r}; use 'mnist1d', 'digits' or a path to a .npz file")


def check(data: Dataset | Corpus, where: str = "the data") -> None:
    """Raise a `DataError` naming the ids out of range in `data`: a corpus's
    tokens outside [0, vocab), a data set's labels below 0, labels that are
    not integers and inputs that are not finite. Run once on loading: inside
    a step an id out of range is not an error but a NaN loss (Flax's `Embed`
    gathers with a fill value) or, negative, a silent wrap-around."""
    if isinstance(data, Corpus):
        for part in ("train", "validation"):
            _in_range(getattr(data, part), 0, data.vocab, f"{where}: {part} tokens",
                      f"ids of a vocabulary of {data.vocab}")
        return
    for part in ("train", "test"):
        x, y = getattr(data, f"x_{part}"), getattr(data, f"y_{part}")
        if not np.issubdtype(np.asarray(y).dtype, np.integer):
            raise DataError(f"{where}: y_{part} holds {np.asarray(y).dtype} labels; give class "
                            "ids as integers")
        _in_range(y, 0, None, f"{where}: y_{part}", "class ids from 0")
        bad = np.flatnonzero(~np.isfinite(np.asarray(x, np.float32)).reshape(len(x), -1).all(1))
        if bad.size:
            raise DataError(f"{where}: x_{part} has non-finite values in {bad.size} examples "
                            f"(first {bad[:5].tolist()})")


def outside(ids: Any, low: int, high: int | None) -> tuple[np.ndarray, list[int]]:
    """The flat positions of `ids` outside [low, high) (below `low` when
    `high` is None), and the first few distinct values there."""
    ids = np.asarray(ids)
    at = np.flatnonzero((ids < low) | (ids >= high) if high is not None else ids < low)
    return at, sorted(set(ids.flat[at[:1000]].tolist()))[:8]


def _in_range(ids: np.ndarray, low: int, high: int | None, what: str, want: str) -> None:
    """Raise naming the values of `ids` outside [low, high) and where they are."""
    at, values = outside(ids, low, high)
    if at.size:
        span = f"below {low}" if high is None else f"outside [{low}, {high})"
        raise DataError(f"{what}: {at.size} {span}, values {values} at positions "
                        f"{at[:5].tolist()}; {what.split(': ')[-1]} must be {want}")


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int,
            epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of one epoch in an order fixed by (seed, epoch); the
    remainder that does not fill a batch is dropped."""
    if batch_size > len(x):
        raise DataError(f"batch size {batch_size} exceeds the {len(x)} training examples")
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]
