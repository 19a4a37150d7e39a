"""The bubble of every schedule's table against its closed form."""

from __future__ import annotations

import pipejax as pj


def bubble_formula(name: str, K: int, M: int, steps: int, v: int = 1) -> tuple[float, str]:
    """Idle share over `steps` steps (and the flush of an asynchronous one)
    by the closed form family `name` states (`Family.bubble`)."""
    closed = pj.schedules.family(name).bubble
    if closed is None:
        raise pj.errors.ConfigError(f"family {name!r} states no closed-form bubble; give it "
                                    "Family.bubble, or leave it out of the bubble rows")
    return closed(K, M, steps, v)


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
