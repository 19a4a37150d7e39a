"""`pipejax train --model NAME` with each image model's defaults: test accuracy and wall time.

Each model trains on MNIST-1D (4000/1000 split) over 4 simulated stages with
GPipe and the model's own default sizes, optimizer and epochs
(`pipejax.cli.setup.MODEL_DEFAULTS`), exactly as the command line runs it;
the row holds the test accuracy of the final parameters and the command's
wall time (compilation included). `pipejax train` with no flags is the MLP's
row: the README's first command. Rows already in the JSON are skipped, so
the table can be made in parts (`--only mlp`).

Run: python benchmarks/train_models.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

from common import RESULTS, load, markdown, save, table
from pipejax.cli import main as cli

MODELS = ("mlp", "snn", "resnet", "vgg", "transformer", "residual_lstm")


def train(model: str) -> dict:
    """One `pipejax train --model MODEL` run, its summary and wall time."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            code = cli(["train", "--model", model, "--quiet", "--out", out])
        seconds = time.perf_counter() - start
        if code != 0:
            raise SystemExit(f"pipejax train --model {model} exited with {code}")
        summary = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
    return {"model": model, "command": f"pipejax train --model {model}",
            "test_accuracy": summary["test_accuracy"], "steps": summary["steps"],
            "seconds": round(seconds, 1)}


def tables() -> dict[str, str]:
    """The training-job page's table from train_models.json, and the
    default MLP's accuracy, which the README and getting started quote."""
    rows = load("train_models")["rows"]
    accuracy = lambda r: f"{100 * r['test_accuracy']:.1f} %"
    return {"rows": markdown([{"command": f"`{r['command']}`", "test accuracy": accuracy(r),
                               "steps": r["steps"], "wall time": f"{r['seconds']:.0f} s"}
                              for r in rows]),
            "mlp": next(accuracy(r) for r in rows if r["model"] == "mlp")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, choices=MODELS)
    args = parser.parse_args()
    rows = load("train_models")["rows"] if (RESULTS / "train_models.json").exists() else []
    for model in args.only or MODELS:
        if any(r["model"] == model for r in rows):
            continue
        rows.append(train(model))
        print(json.dumps(rows[-1]), flush=True)
        rows.sort(key=lambda r: MODELS.index(r["model"]))
        save("train_models", {"stages": 4, "schedule": "gpipe", "data": "mnist1d", "rows": rows})
    print(table(rows))


if __name__ == "__main__":
    main()
