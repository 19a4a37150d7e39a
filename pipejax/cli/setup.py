"""What `pipejax train` and `pipejax plan` share: the devices, the pipeline, numbers in flags."""

from __future__ import annotations

import sys

from pipejax.cli.config import Common
from pipejax.cli.models import build_layers
from pipejax.cli.schedule_flag import schedule_arg


def setup_devices(stages: int, replicas: int = 1, nodes: int = 1, fsdp: int = 1,
                  tensor: int = 1):
    """The mesh to run on (`pj.make_mesh`): the default devices if they are
    accelerators enough for replicas x stages x fsdp x tensor, else simulated
    CPU devices, announced. In a job of several processes, the devices of all of them."""
    import pipejax as pj

    need = stages * replicas * fsdp * tensor
    if not pj.distributed.launched():
        pj.simulate_devices(max(need, 1))
    import jax

    found = jax.devices()
    if (found[0].platform != "cpu" and len(found) >= need) or jax.process_count() > 1:
        return pj.make_mesh(stages, replicas, nodes, fsdp=fsdp, tensor=tensor)
    why = ("no accelerator found" if found[0].platform == "cpu" else
           f"{len(found)} {found[0].platform} device(s) for {need}")
    each = "one per stage of each replica" + (f", {fsdp * tensor} a stage"
                                              if fsdp * tensor > 1 else "")
    print(f"pipejax: {why}; simulating {need} CPU devices, {each} (they share this machine's "
          "cores: no speed-up from pipelining)", file=sys.stderr)
    return pj.make_mesh(stages, replicas, nodes, jax.devices("cpu"), fsdp=fsdp, tensor=tensor)


def partition_arg(cfg: Common) -> str | list[int]:
    """--partition as `pj.pipeline` takes it: an objective or layer counts."""
    if cfg.partition in ("variance", "bottleneck"):
        return cfg.partition
    return [int(n) for n in cfg.partition.split(",")]


def make_pipeline(cfg: Common, task, mesh, weight_stashing: bool = False, seed: int = 0):
    """The model's layers (NNX ones drawn from `seed`) and `pj.pipeline` of
    them for `task` (cli/tasks.py)."""
    import pipejax as pj

    layers = build_layers(cfg.model, getattr(task, "example_shape", ()), task.classes, cfg.api,
                          seed, cfg.model_kwargs())
    mb = cfg.batch_size // (cfg.microbatches * cfg.replicas)
    example, targets = task.example(mb)
    pipe = pj.pipeline(layers, loss=task.loss, example=example, targets=targets,
                       stages=cfg.stages, microbatches=cfg.microbatches,
                       schedule=schedule_arg(cfg), partition=partition_arg(cfg), remat=cfg.remat,
                       mesh=mesh, weight_stashing=weight_stashing,
                       compute_dtype=cfg.compute_dtype, max_padding=cfg.max_padding,
                       virtual=cfg.virtual, placement=cfg.placement, fsdp_gather=cfg.fsdp_gather)
    return layers, pipe


def parse_numbers(text: str, flag: str, counts: tuple[int, ...] = (),
                  example: str = "0.5,0.75") -> list[float]:
    """Comma-separated numbers; `counts`: how many may be given (any if empty)."""
    import pipejax as pj

    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or (counts and len(values) not in counts):
        many = " or ".join(map(str, counts)) or "one or more"
        raise pj.errors.ConfigError(f"{flag} {text!r}: give {many} comma-separated numbers, "
                                    f"e.g. {example}")
    return values
