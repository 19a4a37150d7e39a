"""A trained run on disk: what `pipejax train --out DIR` leaves for `pipejax sample`.

`DIR/run.json` names the model (zoo name or import path, its arguments,
API, seed), the data and, for a language model, its vocabulary and context;
`DIR/checkpoint/` holds the final state as a layout-free orbax checkpoint
(`pj.save`), so the layer list is rebuilt and its variables read back
(`pj.checkpoint.load_variables`) on one device, without the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipejax.cli.config import SampleConfig, TrainConfig
from pipejax.cli.models import api_of, build_layers
from pipejax.cli.tasks import LanguageModel

RUN = "run.json"
CHECKPOINT = "checkpoint"


def checkpoints_of(resume: Path) -> Path:
    """Where `--resume DIR` keeps its checkpoints: `DIR/checkpoint` for a run
    directory (`--out DIR` wrote it), DIR itself for a directory of
    checkpoints or a new or empty one (the first run of a resumable job).

    Raises:
      CheckpointError: DIR is a file, or holds neither checkpoints nor a run.
    """
    import pipejax as pj

    if (resume / RUN).exists() or (resume / CHECKPOINT).is_dir():
        return resume / CHECKPOINT
    if not resume.exists() or (resume.is_dir() and (not any(resume.iterdir())
                                                    or pj.checkpoint.latest(resume) is not None)):
        return resume
    raise pj.errors.CheckpointError(
        f"--resume {resume} holds neither checkpoints (the step folders of pj.save) nor a run "
        f"({RUN} and {CHECKPOINT}/, what --out DIR writes); give one of those, or a new or "
        "empty directory to save into")


def save_run(out: Path, cfg: TrainConfig, trainer, state, task) -> None:
    """The final `state` of `trainer` in `out/checkpoint` (every process of a
    job takes part), the model and `task` in `out/run.json` (the first
    process writes it)."""
    import jax

    import pipejax as pj

    pj.save(out / CHECKPOINT, trainer, state)
    if jax.process_index() > 0:
        return
    language = isinstance(task, LanguageModel)
    api = api_of(trainer.build.code.model.layers)
    run = {"model": cfg.model, "model_args": cfg.model_kwargs(), "api": api, "seed": cfg.seed,
           "data": cfg.data, "step": int(state.step), "language_model": language,
           **({"vocab": task.classes, "context": task.context} if language else {})}
    (out / RUN).write_text(json.dumps(run, indent=1) + "\n")


def sample(cfg: SampleConfig) -> int:
    """`pipejax sample --from DIR`: text from the language model of a saved run."""
    import jax.numpy as jnp

    import pipejax as pj
    from pipejax.cli.tasks import LANGUAGE_MODELS, sample_text

    where = Path(cfg.from_)
    if not (where / RUN).exists() or not (where / CHECKPOINT).is_dir():
        raise pj.errors.CheckpointError(
            f"{where} holds no {RUN} and {CHECKPOINT}/; give the --out directory of a "
            "`pipejax train --model gpt --out DIR` run")
    run = json.loads((where / RUN).read_text())
    kwargs = run["model_args"]
    if not run.get("language_model", run["model"] in LANGUAGE_MODELS):
        raise pj.errors.ConfigError(f"the run in {where} trained --model {run['model']} on "
                                    f"--data {run['data']}, a classifier; sample from a language "
                                    f"model (one trained on a text corpus)")
    context = run.get("context", kwargs.get("context"))
    layers = build_layers(run["model"], (), run.get("vocab", 256), run["api"], run["seed"],
                          kwargs)
    variables = pj.checkpoint.load_variables(where / CHECKPOINT, layers,
                                             jnp.zeros((1, context), jnp.int32), run["step"])
    print(sample_text(layers, variables, cfg.prompt, cfg.length, context, cfg.seed,
                      cfg.temperature, cfg.top_k))
    return 0
