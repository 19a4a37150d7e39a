"""`report.html` of a `pipejax train --out DIR` run: one self-contained page.

Everything a reader of the run needs on one page that opens offline: the
final accuracy (a language model's validation loss, bits per byte and a
sample of its text), the learning curves, the schedule's picture, the partition
plan, the predicted memory, and every setting of the run. The images are
inlined as base64 data URIs, so the file has no external assets.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

_RESULTS = ("test_accuracy", "train_accuracy", "validation_loss", "bits_per_byte", "steps",
            "seconds", "compile_seconds", "examples_per_s", "tokens_per_s")

_STYLE = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
          "pre{background:#f6f6f6;padding:.8em;overflow-x:auto}"
          "td,th{padding:.15em .8em;text-align:left;border-bottom:1px solid #ddd}"
          "img{max-width:100%}")


def _image(png: Path, alt: str) -> str:
    """An <img> whose source is the PNG itself, base64 in a data URI."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(values: dict) -> str:
    """A two-column HTML table: name, value."""
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in values.items())
    return f"<table>{rows}</table>"


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def write_report(out: Path, summary: dict, settings: dict, plan: str, memory: str,
                 headline: str, sample: str | None = None) -> Path:
    """Write `out/report.html` from the run's `summary` (the last line of
    metrics.jsonl) and `headline` (its result in words), its command-line
    `settings`, the printed pipeline `plan` and `memory` estimate, the
    PNGs already in `out` (curve.png, schedule.png) and a language model's
    `sample` of text; returns its path."""
    title = (f"pipejax train: {summary['model']}, {summary['schedule']}, "
             f"K={summary['stages']} stages, M={summary['microbatches']} micro-batches")
    results = {k: summary[k] for k in _RESULTS if k in summary}
    resolved = {k: v for k, v in summary.items() if k not in _RESULTS}
    flags = {k: v for k, v in sorted(settings.items()) if k not in resolved}
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p><b>{html.escape(headline)}</b></p>",
        _table(results),
        *(["<h2>Sample</h2>", _pre(sample)] if sample is not None else []),
        "<h2>Learning curves</h2>", _image(out / "curve.png", "train loss and evaluations"),
        "<h2>Schedule</h2>", _image(out / "schedule.png", f"{summary['schedule']} timeline"),
        "<h2>Plan</h2>", _pre(plan),
        "<h2>Memory</h2>", _pre(memory),
        "<h2>Settings, as run</h2>", _table(resolved),
        "<h3>Other command-line flags</h3>", _table(flags),
    ]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
