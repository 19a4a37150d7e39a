"""The default GPT on Shakespeare's works, trained by the job a user runs: its
validation loss, bits per byte and a sample of its text.

Runs `pipejax train --model gpt --out DIR` with the model's defaults (6
blocks of width 128, context 128; AdamW, warm-up and cosine; 2,000 steps of
32 windows: 8.2 M tokens, about one pass over the training text; 4 simulated
stages, GPipe), then `pipejax sample` from the saved run, and writes the
run's summary, its validation curve and both samples to
results/lm_sample.json. About 15 minutes on 2 cores.

Run: python benchmarks/lm_sample.py [extra pipejax train flags]
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
import tempfile
from pathlib import Path

from common import save
from pipejax.cli import main as pipejax

PROMPT = "KING HENRY. "


def run(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gpt"
        command = ["train", "--model", "gpt", "--quiet", "--prompt", PROMPT, "--out", str(out),
                   *flags]
        if pipejax(command) != 0:
            raise SystemExit("pipejax train failed")
        rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        printed = io.StringIO()
        sample = ["sample", "--from", str(out), "--prompt", PROMPT, "--length", "400",
                  "--temperature", "0.8", "--seed", "1"]
        with contextlib.redirect_stdout(printed):
            if pipejax(sample) != 0:
                raise SystemExit("pipejax sample failed")
        shown = lambda argv: shlex.join(["pipejax", *argv]).replace(str(out), "DIR")
        return {"command": shown(command), "sample_command": shown(sample),
                "summary": rows[-1],
                "validation": [{"step": r["step"], "validation_loss": round(r["validation_loss"], 4)}
                               for r in rows[:-1] if "validation_loss" in r],
                "report_sample": (out / "sample.txt").read_text(),
                "sample": printed.getvalue()}


if __name__ == "__main__":
    result = run(sys.argv[1:])
    path = save("lm_sample", result)
    s = result["summary"]
    print(f"validation loss {s['validation_loss']:.4f} nats, {s['bits_per_byte']:.4f} bits per "
          f"byte, {s['tokens_per_s']:.0f} tokens/s, {s['seconds']:.0f} s\n\n{result['sample']}"
          f"\nwritten to {path}")
