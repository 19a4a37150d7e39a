"""A trained run on disk: what `pipejax train --out DIR` leaves for `pipejax sample`.

`DIR/run.json` names the model (zoo name, API, seed, data) and
`DIR/checkpoint/` holds the final state as a layout-free orbax checkpoint
(`pj.save`), so the layer list is rebuilt and its variables read back
(`pj.checkpoint.load_variables`) on one device, without the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipejax.cli.config import SampleConfig, TrainConfig

RUN = "run.json"
CHECKPOINT = "checkpoint"


def save_run(out: Path, cfg: TrainConfig, trainer, state) -> None:
    """The final `state` of `trainer` in `out/checkpoint` (every process of a
    job takes part), the model in `out/run.json` (the first process writes it)."""
    import jax

    import pipejax as pj

    pj.save(out / CHECKPOINT, trainer, state)
    if jax.process_index() > 0:
        return
    run = {"model": cfg.model, "model_args": cfg.model_kwargs(), "api": cfg.api, "seed": cfg.seed,
           "data": cfg.data, "step": int(state.step)}
    (out / RUN).write_text(json.dumps(run, indent=1) + "\n")


def sample(cfg: SampleConfig) -> int:
    """`pipejax sample --from DIR`: text from the language model of a saved run."""
    import jax.numpy as jnp

    import pipejax as pj
    from pipejax.cli.models import build_layers
    from pipejax.cli.tasks import LANGUAGE_MODELS, sample_text

    where = Path(cfg.from_)
    if not (where / RUN).exists() or not (where / CHECKPOINT).is_dir():
        raise pj.errors.CheckpointError(
            f"{where} holds no {RUN} and {CHECKPOINT}/; give the --out directory of a "
            "`pipejax train --model gpt --out DIR` run")
    run = json.loads((where / RUN).read_text())
    if run["model"] not in LANGUAGE_MODELS:
        raise pj.errors.ConfigError(f"the run in {where} trained --model {run['model']}, a "
                                    f"classifier; sample from a language model "
                                    f"({', '.join(LANGUAGE_MODELS)})")
    kwargs = run["model_args"]
    context = kwargs["context"]
    layers = build_layers(run["model"], (), 256, run["api"], run["seed"],
                          kwargs)
    variables = pj.checkpoint.load_variables(where / CHECKPOINT, layers,
                                             jnp.zeros((1, context), jnp.int32), run["step"])
    print(sample_text(layers, variables, cfg.prompt, cfg.length, context, cfg.seed,
                      cfg.temperature, cfg.top_k))
    return 0
