"""The bubble of every schedule's table against its closed form."""

from __future__ import annotations

import pipejax as pj


def bubble_formula(name: str, K: int, M: int, steps: int, v: int = 1) -> tuple[float, str]:
    """Idle share over `steps` steps (and the flush of an asynchronous one):
    a synchronous step fills and drains every step (GPipe §2), v chunks per
    device v-fold less (Narayanan et al. 2021, with K | M); a zero-bubble
    step runs 3vM ops a device in 3vM + K − 1 ticks (Qi et al. 2024, ZB-H1
    with F = B = W); PipeDream fills once; PB's backward lane also waits
    K − 1 ticks for its first gradient."""
    if name in ("gpipe", "1f1b", "interleaved"):
        return (K - 1) / (v * M + K - 1), "(K-1)/(vM+K-1)" if v > 1 else "(K-1)/(M+K-1)"
    if name in ("zb-h1", "zb-h2"):
        return (K - 1) / (3 * v * M + K - 1), "(K-1)/(3vM+K-1)"
    if name == "pb":
        return 2 * (K - 1) / (steps * M + 2 * (K - 1)), "2(K-1)/(nM+2(K-1))"
    return (K - 1) / (steps * M + K - 1), "(K-1)/(nM+K-1)"


def bubbles() -> list[dict]:
    rows = []
    cases = [(name, 1) for name in ("gpipe", "1f1b", "pipedream", "pb", "zb-h1", "zb-h2")]
    cases += [(name, 2) for name in ("gpipe", "interleaved", "zb-h1")]
    for name, v in cases:
        for K, M in ((4, 8), (8, 32)):
            s = pj.schedules.make_schedule(name, pj.Placement(K, v), M)
            one, formula = bubble_formula(name, K, M, 1, v)
            many, _ = bubble_formula(name, K, M, 32, v)
            table = lambda steps: round(pj.schedules.bubble_fraction(s, steps), 4)
            rows.append({"schedule": name, "v": v, "K": K, "M": M, "ticks": s.ticks,
                         "table_n=1": table(1), "formula_n=1": round(one, 4),
                         "table_n=32": table(32),
                         "formula_n=32": round(many, 4), "formula": formula})
    return rows
