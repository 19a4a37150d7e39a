"""Text for people: byte counts and aligned tables (plans, memory estimates, benchmarks)."""

from __future__ import annotations

from typing import Sequence


def human_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def parse_bytes(text: str) -> int:
    """`text` ("16GiB", "512 MiB", "2e9") as bytes: B, KiB, MiB, GiB, TiB, or
    KB, MB, GB, TB in powers of 1000."""
    from pipejax.errors import ConfigError

    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10, "tb": 1e12, "gb": 1e9,
             "mb": 1e6, "kb": 1e3, "b": 1}
    t = text.strip().lower()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        n = float(t[:len(t) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        n = -1.0
    if not 0 < n < float("inf"):
        raise ConfigError(f"{text!r} is not a byte count; write e.g. 16GiB, 512MiB or 2e9")
    return int(n)


def table(rows: Sequence[Sequence[str]], *, rstrip: bool = True) -> str:
    """`rows` as left-aligned columns two spaces apart, the first row a header
    underlined by dashes; `rstrip=False` keeps the padding at the end of lines."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    if rstrip:
        lines = [line.rstrip() for line in lines]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def in_words(items: list) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)
