"""Pictures of a schedule table: a text Gantt chart and a PNG timeline.

A synchronous table is a whole step, fill and drain included, so its
picture shows the fill/drain bubble; an asynchronous table is one period of
the steady state, so its picture shows that period's own bubble, and the
fill/drain bubble of one step from an empty pipeline to an empty one apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipejax.schedules.timeline import NONE

if TYPE_CHECKING:
    from pipejax.schedules.schedule import Schedule


def _cell(schedule: Schedule, t: int, k: int) -> str:
    f, b = schedule.fwd[t, k], schedule.bwd[t, k]
    return "".join(p + str(v) for p, v in (("F", f), ("B", b)) if v != NONE) or "."


def _shows(schedule: Schedule) -> str:
    """What the table pictures: one steady-state period or one whole step."""
    return "one steady-state period" if schedule.asynchronous else "one step, fill and drain"


def _bubbles(schedule: Schedule) -> str:
    """The bubble of what the picture shows, named: the steady-state bubble of
    an asynchronous period (read off the table drawn), then the fill/drain
    bubble of one step from an empty pipeline to an empty one; a synchronous
    step's fill/drain bubble."""
    fill_drain = f"fill/drain bubble={schedule.bubble_fraction:.3f}"
    if schedule.synchronous:
        return fill_drain
    return f"steady-state bubble={schedule.table_bubble_fraction:.3f} ({fill_drain} over one step)"


def render(schedule: Schedule) -> str:
    """Text Gantt chart: one row per stage, one column per tick."""
    width = max(4, *(len(_cell(schedule, t, k)) + 1 for t in range(schedule.ticks)
                     for k in range(schedule.stages)))
    rows = ["tick    " + "".join(str(t).rjust(width) for t in range(schedule.ticks))]
    for k in range(schedule.stages):
        rows.append(f"stage {k} " + "".join(_cell(schedule, t, k).rjust(width)
                                             for t in range(schedule.ticks)))
    kind = "asynchronous" if schedule.asynchronous else "synchronous"
    rows.append(f"{schedule.name} ({kind}, {_shows(schedule)}): K={schedule.stages} "
                f"M={schedule.microbatches} ticks={schedule.ticks} {_bubbles(schedule)} "
                f"delays={schedule.delays}")
    return "\n".join(rows)


def plot(schedule: Schedule, path: str) -> None:
    """PNG timeline: forward, backward and idle cells coloured, micro-batch
    numbers in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K, T = schedule.stages, schedule.ticks
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * T), 0.6 * K + 1.2))
    for t in range(T):
        for k in range(K):
            f, b = schedule.fwd[t, k], schedule.bwd[t, k]
            parts = [(c, v) for c, v in (("#4c9be8", f), ("#f08a4b", b)) if v != NONE]
            if not parts:
                ax.add_patch(plt.Rectangle((t, k), 1, 1, color="#eeeeee", ec="white"))
            for i, (color, v) in enumerate(parts):
                h = 1 / len(parts)
                ax.add_patch(plt.Rectangle((t, k + i * h), 1, h, color=color, ec="white"))
                ax.text(t + 0.5, k + (i + 0.5) * h, str(v), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, T), ax.set_ylim(K, 0)
    ax.set_xlabel("tick"), ax.set_yticks([k + 0.5 for k in range(K)])
    ax.set_yticklabels([f"stage {k}" for k in range(K)])
    ax.set_title(f"{schedule.name}: K={K} M={schedule.microbatches}, {_shows(schedule)} (blue "
                 f"forward, orange backward)\n{_bubbles(schedule)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
