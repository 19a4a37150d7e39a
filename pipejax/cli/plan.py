"""`pipejax plan`: the partition table and the schedule timeline of a
configuration, or with --search `pj.search`'s ranking of them."""

from __future__ import annotations

import dataclasses
import sys

from pipejax.cli.config import PlanConfig
from pipejax.cli.machine import machine
from pipejax.cli.models import build_layers
from pipejax.cli.setup import make_pipeline, parse_numbers, partition_arg, setup_devices
from pipejax.cli.tasks import load_task
from pipejax.schedules import plot, render


def plan(cfg: PlanConfig) -> int:
    """Print the plan and timeline of `cfg`'s pipeline (with --search, of the
    picked candidate, or only the ranking)."""
    if cfg.search:
        cfg = search(cfg)
        if cfg is None:
            return 0
    mesh = setup_devices(cfg.stages, cfg.replicas, cfg.nodes, cfg.fsdp, cfg.tensor)
    task = load_task(cfg.model, cfg.data, cfg.model_kwargs().get("context"), 0, 0)
    _, pipe = make_pipeline(cfg, task, mesh)
    print(pipe)
    print()
    print(render(pipe.schedule))
    info = [pipe.schedule.stage_info(k) for k in range(pipe.K)]
    print("delays D_k " + str([i.delay for i in info]) + ", SpecTrain horizons (forward, backward) "
          + str([(i.forward_horizon, i.backward_horizon) for i in info]))
    if cfg.plot:
        plot(pipe.schedule, str(cfg.plot))
        print(f"timeline drawn to {cfg.plot}")
    return 0


def search(cfg: PlanConfig) -> PlanConfig | None:
    """Print `pj.search`'s ranking; with --pick, the config of the picked
    candidate (whose plan follows), else None."""
    import jax

    from pipejax import planner
    from pipejax.errors import ConfigError
    from pipejax.formatting import parse_bytes

    setup_devices(cfg.devices)
    kwargs = cfg.model_kwargs()
    task = load_task(cfg.model, cfg.data, kwargs.get("context"), 0, 0)
    example, targets = task.example(1)
    layers = build_layers(cfg.model, getattr(task, "example_shape", ()), task.classes, cfg.api,
                          0, kwargs)
    reference = cfg.reference and parse_numbers(cfg.reference, "--reference", (3,),
                                                "0.1,0.9,128")
    memory = None if cfg.memory is None else parse_bytes(cfg.memory)
    ranked = planner.search(
        layers, loss=task.loss, example=jax.tree.map(lambda a: a[0], example),
        targets=None if targets is None else jax.tree.map(lambda a: a[0], targets),
        machine=machine(cfg.machine, cfg.compute_dtype or "float32", cfg.devices, memory),
        training=planner.Training(
            batch=cfg.batch_size, learning_rate=cfg.lr, momentum=cfg.momentum,
            reference=reference and (reference[0], reference[1], int(reference[2]))),
        space=planner.Space(schedules=cfg.schedules and cfg.schedules.split(","),
                            fsdp=(cfg.fsdp,), tensor=(cfg.tensor,),
                            compute_dtypes=(cfg.compute_dtype,), partition=partition_arg(cfg)),
        progress=_progress if sys.stderr.isatty() else None)
    print(planner.render(ranked, limit=max(20, (cfg.pick or 0) + 1)))
    if cfg.pick is None:
        return None
    if not 0 <= cfg.pick < len(ranked):
        raise ConfigError(f"--pick {cfg.pick}: the search found {len(ranked)} candidates, "
                          f"numbered from 0")
    c = ranked[cfg.pick]
    print(f"\ncandidate {cfg.pick}: {c.advice}\n")
    return dataclasses.replace(
        cfg, stages=c.stages, replicas=c.data, fsdp=c.fsdp, tensor=c.tensor,
        microbatches=c.microbatches,
        schedule=c.schedule,
        virtual=c.virtual, remat=c.remat,
        compute_dtype=None if c.compute_dtype == "float32" else c.compute_dtype)


def _progress(tried: int, total: int) -> None:
    """The search's progress on one line of the terminal."""
    end = "\n" if tried == total else ""
    print(f"\rsearching: {tried}/{total} configurations", end=end, file=sys.stderr, flush=True)
