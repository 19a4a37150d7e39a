"""The bubble of every schedule's table against its closed form."""

from __future__ import annotations

import pipejax as pj


def bubble_formula(name: str, K: int, M: int, steps: int) -> tuple[float, str]:
    """Idle share over `steps` steps (and the flush of an asynchronous one):
    a synchronous step fills and drains every step (GPipe §2); PipeDream fills
    once; PB's backward lane also waits K − 1 ticks for its first gradient."""
    if name in ("gpipe", "1f1b"):
        return (K - 1) / (M + K - 1), "(K-1)/(M+K-1)"
    if name == "pb":
        return 2 * (K - 1) / (steps * M + 2 * (K - 1)), "2(K-1)/(nM+2(K-1))"
    return (K - 1) / (steps * M + K - 1), "(K-1)/(nM+K-1)"


def bubbles() -> list[dict]:
    rows = []
    for name in ("gpipe", "1f1b", "pipedream", "pb"):
        for K, M in ((4, 8), (8, 32)):
            s = pj.schedules.make_schedule(name, K, M)
            one, formula = bubble_formula(name, K, M, 1)
            many, _ = bubble_formula(name, K, M, 32)
            rows.append({"schedule": name, "K": K, "M": M, "ticks": s.ticks,
                         "table_n=1": round(s.bubble_fraction, 4), "formula_n=1": round(one, 4),
                         "table_n=32": round(s.bubble_fraction_over(32), 4),
                         "formula_n=32": round(many, 4), "formula": formula})
    return rows
