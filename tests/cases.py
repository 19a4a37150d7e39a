"""Which parameter sets `make test` runs: one case of each code path, the
others marked slow (`make test-all` runs every case)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def fast_and_slow(cases: Iterable, fast: Iterable, ids=None) -> list:
    """`cases` as pytest parameters, those not in `fast` marked slow."""
    fast = set(fast)
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                         marks=() if c in fast else pytest.mark.slow,
                         id=None if ids is None else ids(c)) for c in cases]
