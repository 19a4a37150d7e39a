"""`pipejax train --model NAME` with each image model's defaults: test accuracy and wall time.

Each model trains on MNIST-1D (4000/1000 split) over 4 simulated stages with
GPipe and the model's own default sizes, optimizer and epochs
(`pj.models.MODELS`), exactly as the command line runs it;
the row holds the test accuracy of the final parameters and the command's
wall time (compilation included). `pipejax train` with no flags is the MLP's
row: the README's first command. The example scripts that print a test
accuracy (`examples/nnx_transformer.py`) run as their own rows. Rows already
in the JSON are skipped, so the table can be made in parts (`--only mlp`).

Run: python benchmarks/train_models.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, load, markdown, save, table
from pipejax.cli import main as cli

MODELS = ("mlp", "snn", "resnet", "vgg", "transformer", "residual_lstm")
EXAMPLES = ("nnx_transformer",)  # examples/NAME.py, which prints "test accuracy X"


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


def run_example(name: str) -> dict:
    """`python examples/NAME.py`: the test accuracy it prints and its wall time."""
    script = Path(__file__).parent.parent / "examples" / f"{name}.py"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    found = re.search(r"^test accuracy ([\d.]+)$", out.stdout, re.M)
    if out.returncode != 0 or not found:
        raise SystemExit(f"examples/{name}.py exited with {out.returncode}:\n{out.stderr[-2000:]}")
    return {"model": name, "command": f"python examples/{name}.py",
            "test_accuracy": float(found[1]), "seconds": round(seconds, 1)}


def tables() -> dict[str, str]:
    """The training-job page's table from train_models.json, the default
    MLP's accuracy, which the README and getting started quote, and each
    example's accuracy and time."""
    results = load("train_models")
    rows = results["rows"]
    accuracy = lambda r: f"{100 * r['test_accuracy']:.1f} %"
    examples = {r["model"]: f"{accuracy(r)} test accuracy on MNIST-1D in {r['seconds']:.0f} s"
                for r in results.get("examples", [])}
    return {"rows": markdown([{"command": f"`{r['command']}`", "test accuracy": accuracy(r),
                               "steps": r["steps"], "wall time": f"{r['seconds']:.0f} s"}
                              for r in rows]),
            "mlp": next(accuracy(r) for r in rows if r["model"] == "mlp"), **examples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, choices=MODELS + EXAMPLES)
    args = parser.parse_args()
    old = load("train_models") if (RESULTS / "train_models.json").exists() else {}
    rows, examples = old.get("rows", []), old.get("examples", [])
    for name in args.only or MODELS + EXAMPLES:
        done, order = (rows, MODELS) if name in MODELS else (examples, EXAMPLES)
        if any(r["model"] == name for r in done):
            continue
        done.append(train(name) if name in MODELS else run_example(name))
        print(json.dumps(done[-1]), flush=True)
        done.sort(key=lambda r: order.index(r["model"]))
        save("train_models", {"stages": 4, "schedule": "gpipe", "data": "mnist1d", "rows": rows,
                              "examples": examples})
    print(table(rows))


if __name__ == "__main__":
    main()
