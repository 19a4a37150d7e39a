"""Pictures of a schedule table: a text Gantt chart and a PNG timeline.

A synchronous table is a whole step, fill and drain included, so its
picture shows the fill/drain bubble; an asynchronous table is one period of
the steady state, so its picture shows that period's own bubble, and the
fill/drain bubble of one step from an empty pipeline to an empty one apart.
"""

from __future__ import annotations

from pipejax.schedules.bubbles import bubble_fraction, table_bubble_fraction
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op

_LETTER = {Op.F: "F", Op.B: "B", Op.W: "W", Op.BW: "B"}
_COLOR = {Op.F: "#4c9be8", Op.B: "#f08a4b", Op.W: "#5cb85c", Op.BW: "#f08a4b"}
_MIXED_BW = "#b5523b"  # BW in a table that also splits backwards (DualPipeV's drain)


def _tasks(schedule: Schedule, t: int, k: int) -> list[tuple[Op, str]]:
    """The ops of a cell in lane order, each with its label: the micro-batch,
    and with virtual stages its chunk after a dot (3.1: micro-batch 3, chunk 1)."""
    out = []
    for op, m, c in schedule.table[t, k]:
        if op != Op.IDLE:
            out.append((Op(op), f"{m}.{c}" if schedule.placement.virtual > 1 else str(m)))
    return out


def _mixed(schedule: Schedule) -> bool:
    """Whether the table runs fused backwards (BW) and split ones (B, W)."""
    return bool((schedule.ops == Op.B).any() and (schedule.ops == Op.BW).any())


def _letter(schedule: Schedule, op: Op) -> str:
    """B for a backward; in a table that also splits backwards, the fused one is BW."""
    return "BW" if op == Op.BW and _mixed(schedule) else _LETTER[op]


def _cell(schedule: Schedule, t: int, k: int) -> str:
    return "".join(_letter(schedule, op) + label for op, label in _tasks(schedule, t, k)) or "."


def _placement(schedule: Schedule) -> str:
    """The chunks a device holds, when it holds more than one."""
    p = schedule.placement
    return "" if p.virtual == 1 else f" v={p.virtual}" + (" (V placement)" if p.kind == "v" else "")


def _legend(schedule: Schedule) -> str:
    """What the colours and letters mean, for the ops the table runs."""
    ops = {Op(o) for o in schedule.ops.flat if o != Op.IDLE}
    names = {Op.F: "F forward", Op.B: "B input gradient", Op.W: "W weight gradient",
             Op.BW: f"{_letter(schedule, Op.BW)} whole backward"}
    colors = {Op.F: "blue", Op.B: "orange", Op.W: "green",
              Op.BW: "red" if _mixed(schedule) else "orange"}
    parts = [f"{colors[o]} {names[o]}" for o in Op if o in ops]
    chunks = ("; m.c = micro-batch m on chunk c, darker = later chunk"
              if schedule.placement.virtual > 1 else "")
    return ", ".join(parts) + chunks


def _shows(schedule: Schedule) -> str:
    """What the table pictures: one steady-state period or one whole step."""
    return "one steady-state period" if schedule.asynchronous else "one step, fill and drain"


def _bubbles(schedule: Schedule) -> str:
    """The bubble of what the picture shows, named: the steady-state bubble of
    an asynchronous period (read off the table drawn), then the fill/drain
    bubble of one step from an empty pipeline to an empty one; a synchronous
    step's fill/drain bubble."""
    fill_drain = f"fill/drain bubble={bubble_fraction(schedule):.3f}"
    if schedule.synchronous:
        return fill_drain
    steady = table_bubble_fraction(schedule)
    return f"steady-state bubble={steady:.3f} ({fill_drain} over one step)"


def render(schedule: Schedule) -> str:
    """Text Gantt chart: one row per stage, one column per tick."""
    width = max(4, *(len(_cell(schedule, t, k)) + 1 for t in range(schedule.ticks)
                     for k in range(schedule.stages)))
    rows = ["tick    " + "".join(str(t).rjust(width) for t in range(schedule.ticks))]
    for k in range(schedule.stages):
        rows.append(f"stage {k} " + "".join(_cell(schedule, t, k).rjust(width)
                                             for t in range(schedule.ticks)))
    kind = "asynchronous" if schedule.asynchronous else "synchronous"
    rows.append(f"{schedule.name} ({kind}, {_shows(schedule)}): K={schedule.stages}"
                f"{_placement(schedule)} "
                f"M={schedule.microbatches} ticks={schedule.ticks} {_bubbles(schedule)} "
                f"delays={schedule.delays}")
    rows.append(f"  {_legend(schedule)}")
    return "\n".join(rows)


def plot(schedule: Schedule, path: str) -> None:
    """PNG timeline: forward, backward and idle cells coloured, micro-batch
    numbers in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K, T, v = schedule.stages, schedule.ticks, schedule.placement.virtual
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * T), 0.6 * K + 1.4))
    for t in range(T):
        for k in range(K):
            parts = _tasks(schedule, t, k)
            if not parts:
                ax.add_patch(plt.Rectangle((t, k), 1, 1, color="#eeeeee", ec="white"))
            for i, (op, label) in enumerate(parts):
                h, c = 1 / len(parts), int(label.split(".")[1]) if v > 1 else 0
                shade = 1.0 - 0.45 * c / max(v - 1, 1)  # later chunks darker
                color = _MIXED_BW if op == Op.BW and _mixed(schedule) else _COLOR[op]
                rgb = [min(1.0, x * shade) for x in matplotlib.colors.to_rgb(color)]
                ax.add_patch(plt.Rectangle((t, k + i * h), 1, h, color=rgb, ec="white"))
                ax.text(t + 0.5, k + (i + 0.5) * h, label, ha="center", va="center",
                        fontsize=7 if v == 1 else 5.5)
    ax.set_xlim(0, T), ax.set_ylim(K, 0)
    ax.set_xlabel("tick"), ax.set_yticks([k + 0.5 for k in range(K)])
    ax.set_yticklabels([f"stage {k}" for k in range(K)])
    ax.set_title(f"{schedule.name}: K={K}{_placement(schedule)} M={schedule.microbatches}, "
                 f"{_shows(schedule)}\n"
                 f"{_legend(schedule)}\n{_bubbles(schedule)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
