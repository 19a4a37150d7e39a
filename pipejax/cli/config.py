"""The command line's settings: the parsed flags of one command as a frozen
dataclass, with what follows from them worked out once when it is built.

`TrainConfig` and `PlanConfig` share the pipeline's flags (`Common`);
`SampleConfig` is `pipejax sample`'s. A flag left out takes the model's
default (`models.training_defaults`), then `models.FLAG_DEFAULTS`; the batch
size follows from --microbatch-size when it is given. A variant, such as the
candidate `plan --search --pick` builds, is `dataclasses.replace` of a
config, never an assignment.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pipejax.cli.models import FLAG_DEFAULTS, check_model, model_kwargs, training_defaults
from pipejax.cli.tasks import default_data, is_text
from pipejax.errors import ConfigError

DERIVED = {"derived": True}  # a field's metadata: worked out, not a flag


@dataclasses.dataclass(frozen=True)
class Common:
    """The flags of the pipeline that `train` and `plan` build."""

    model: str
    model_args: str | None
    api: str
    data: str
    stages: int
    microbatches: int
    batch_size: int
    microbatch_size: int | None
    schedule: str
    virtual: int | None
    placement: str | None
    partition: str
    remat: str
    compute_dtype: str | None
    max_padding: float | None
    replicas: int
    nodes: int
    fsdp: int
    fsdp_gather: str
    tensor: int

    @classmethod
    def of(cls, flags: dict) -> "Common":
        """The config of parsed `flags` (argparse's namespace as a dict): the
        flags left out filled from the model's defaults, then the rest
        derived (`derive`)."""
        fields = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")}
        check_model(flags["model"])
        flags = dict(flags, data=flags["data"] or default_data(flags["model"]))
        filled, text = set(), is_text(flags["data"])
        for key, value in {**FLAG_DEFAULTS, **training_defaults(flags["model"], text)}.items():
            if key not in fields or flags.get(key) is not None or _kept_out(key, flags):
                continue
            flags[key], filled = value, filled | {key}
        flags["batch_size"] = _batch_size(flags)
        model_kwargs(flags["model"], flags["model_args"])  # a bad --model-args fails here
        return cls(**{**flags, **cls.derive(flags, filled)})

    @classmethod
    def derive(cls, flags: dict, filled: set[str]) -> dict:
        """What follows from the filled `flags`: the flags whose defaults
        depend on others, and the derived fields (none here)."""
        return {}

    def model_kwargs(self) -> dict:
        """The model's builder arguments (`models.model_kwargs`)."""
        return model_kwargs(self.model, self.model_args)

    def flags(self) -> dict[str, Any]:
        """The flags as this run took them (the derived fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.metadata.get("derived")}


def _kept_out(key: str, flags: dict) -> bool:
    """Whether a model default stays out although its flag was left out:
    --lr stays None (--reference sets the rate when --lr is left out); given
    --epochs keeps the model's --steps out and given --microbatch-size its
    --batch-size (each sets the other's quantity); --reference scales
    momentum, not a model's adamw."""
    return (key == "lr" or (key == "steps" and flags.get("epochs") is not None)
            or (key == "batch_size" and flags["microbatch_size"] is not None)
            or (key == "optimizer" and bool(flags.get("reference"))))


def _batch_size(flags: dict) -> int:
    """Examples per step: --batch-size, or --microbatch-size x --microbatches x
    --replicas (both given must agree); 128 by default."""
    size, micro = flags["batch_size"], flags["microbatch_size"]
    if micro is None:
        return 128 if size is None else size
    if micro < 1:
        raise ConfigError(f"--microbatch-size {micro}; use 1 or more")
    per_step = flags["microbatches"] * flags["replicas"]
    if size is not None and size != micro * per_step:
        raise ConfigError(f"--batch-size {size} disagrees with --microbatch-size {micro} x "
                          f"--microbatches {flags['microbatches']} x --replicas "
                          f"{flags['replicas']} = {micro * per_step}; give one of the two")
    return micro * per_step


@dataclasses.dataclass(frozen=True)
class TrainConfig(Common):
    """`pipejax train`'s flags."""

    optimizer: str
    weight_decay: float
    lr: float | None
    momentum: float | None
    mitigation: str | None
    horizon_scale: float
    form: str | None
    reference: str | None
    lr_schedule: str
    decay_at: str
    warmup: int
    rule: str | None
    alpha: float
    every: int
    processes: int
    epochs: int | None
    steps: int | None
    seed: int
    eval_every: int
    eval_windows: int
    out: Path | None
    prompt: str
    sample_length: int
    temperature: float
    quiet: bool
    resume: Path | None
    save_every: int
    clip: float | None
    skip_nonfinite: bool
    warmup_defaulted: bool = dataclasses.field(default=False, metadata=DERIVED)

    @classmethod
    def derive(cls, flags: dict, filled: set[str]) -> dict:
        """--optimizer's default (momentum with --reference, else adam) and
        whether --warmup is the model's (then at most a tenth of the run)."""
        optimizer = flags["optimizer"] or ("momentum" if flags["reference"] else "adam")
        return {"optimizer": optimizer, "warmup_defaulted": "warmup" in filled}

    @property
    def learning_rate(self) -> float:
        """--lr, else the model's default rate."""
        if self.lr is not None:
            return self.lr
        return training_defaults(self.model, is_text(self.data))["lr"]


@dataclasses.dataclass(frozen=True)
class PlanConfig(Common):
    """`pipejax plan`'s flags."""

    plot: Path | None
    search: bool
    devices: int
    schedules: str | None
    memory: str | None
    reference: str | None
    lr: float | None
    momentum: float
    machine: str | None
    pick: int | None


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """`pipejax sample`'s flags."""

    from_: Path
    prompt: str
    length: int
    temperature: float
    top_k: int | None
    seed: int

    @classmethod
    def of(cls, flags: dict) -> "SampleConfig":
        """The config of parsed `flags` (nothing to derive)."""
        return cls(**flags)


Config = TrainConfig | PlanConfig | SampleConfig


def config(args: argparse.Namespace, kind: type[Config]) -> Config:
    """The `kind` of config of a parsed command line."""
    return kind.of({k: v for k, v in vars(args).items() if k != "command"})
