"""`pipejax train`: train a model with a pipelined step; metrics, curve,
parameters and a report out.

Before the first step it prints the predicted memory per device and the
time `trainer.step` takes to compile; a later step that compiles again
(jax.monitoring's XLA compile event) is announced with what changed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax

from pipejax.cli.config import TrainConfig
from pipejax.cli.models import api_of
from pipejax.cli.optimizer import describe_optimizer, make_optimizer
from pipejax.cli.outputs import Run, finish
from pipejax.cli.run import checkpoints_of, save_run
from pipejax.cli.schedule_flag import synchronous as is_synchronous, updates_per_step
from pipejax.cli.setup import make_pipeline, setup_devices
from pipejax.cli.tasks import load_task

XLA_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event, in seconds


def _signature(tree: Any) -> list[tuple[str, str]]:
    """(path, "dtype[shape] sharding") of every array of `tree`: what jit's cache keys on."""
    return [(jax.tree_util.keystr(path), f"{a.dtype}[{','.join(map(str, a.shape))}]"
             + (f" {a.sharding.spec}" if hasattr(getattr(a, "sharding", None), "spec") else ""))
            for path, a in jax.tree_util.tree_leaves_with_path(tree)]


def _change(name: str, now: list[tuple[str, str]], first: list[tuple[str, str]]) -> str | None:
    """The first array of `now` that differs from `first`, named, or None."""
    if len(now) != len(first):
        return f"the {name} holds {len(now)} arrays, at the first step {len(first)}"
    return next((f"the {name}{p} is {a}, at the first step {b}"
                 for (p, a), (_, b) in zip(now, first) if a != b), None)


def _compiling(call: Callable[[], Any]) -> tuple[Any, list[float]]:
    """`call()`, and the seconds of each XLA compilation it ran (jax.monitoring's events)."""
    seconds: list[float] = []

    def listen(event: str, duration: float, **_) -> None:
        if event == XLA_COMPILE:
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        return call(), seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class StepCompiles:
    """`trainer.step`, its compilations told: the first made ahead of the
    first step and timed (trace, lower, XLA compile), any later one (an XLA
    compilation during a step) announced by `say` with the argument that
    changed since the first step."""

    def __init__(self, trainer, say: Callable[[str], Any]):
        self.trainer, self.say = trainer, say
        self.seconds: float | None = None  # the first compilation's; None before the first step
        self._first: tuple = ()  # the signatures of the first step's batch and state

    def __call__(self, state, batch, step: int) -> tuple:
        """`trainer.step(state, batch)` as the run's `step`-th step."""
        if self.seconds is None:
            start = time.perf_counter()
            self.trainer.step.lower(state, batch).compile()
            self.seconds = time.perf_counter() - start
            self._first = _signature(batch), _signature(state)
            self.say(f"trainer.step compiled in {self.seconds:.1f} s")
        out, seconds = _compiling(lambda: self.trainer.step(state, batch))
        if seconds:
            why = (_change("batch", _signature(batch), self._first[0])
                   or _change("state", _signature(state), self._first[1])
                   or "the batch and state are shaped and placed as at the first step")
            self.say(f"step {step} recompiled trainer.step in {sum(seconds):.1f} s: {why}")
        return out


def _loop(cfg: TrainConfig, trainer, state, task, total: int):
    """Steps `state.step` to `total` over the task's batches (a resumed run
    goes on with the batch it would have had next), then a flush; returns the
    state, the metric rows, the seconds it took and those of the first
    compilation (None if no step ran)."""
    import pipejax as pj
    from tqdm import tqdm

    rows: list[dict] = []
    step, start = int(state.step), time.perf_counter()
    first = step
    bar = tqdm(total=total, initial=step, unit="step", disable=cfg.quiet, dynamic_ncols=True)
    step_once = StepCompiles(trainer, bar.write if jax.process_index() == 0 else lambda _: None)
    rate_name = "ex_per_s" if task.unit == "examples" else "tok_per_s"
    batches = task.batches(cfg.batch_size, step)
    while step < total:
        epoch, batch = next(batches)
        state, metrics = step_once(state, batch, step + 1)
        step += 1
        if cfg.save_every and step % cfg.save_every == 0:
            pj.save(cfg.resume, trainer, state)
        if (step % 20 == 0 or step == total) and int(metrics["completed"]):
            loss = float(metrics["loss"])
            rate = (step - first) * task.items(cfg.batch_size) / (time.perf_counter() - start)
            bar.set_postfix({"loss": f"{loss:.4f}", rate_name: f"{rate:.0f}"})
            rows.append({"step": step, "epoch": epoch, "loss": loss})
            if "skipped" in metrics:
                rows[-1]["skipped"] = int(metrics["skipped"])
            if "consensus_distance" in metrics:
                rows[-1]["consensus_distance"] = float(metrics["consensus_distance"])
        if cfg.eval_every and step % cfg.eval_every == 0:
            result = task.evaluate(pj.unstage(state))
            rows.append({"step": step, "epoch": epoch, **result})
            bar.write(f"step {step}: {task.describe(result)}")
        bar.update(1)
    bar.close()
    state, _ = trainer.flush(state)  # an asynchronous pipeline finishes what is in flight
    if cfg.resume is not None:
        pj.save(cfg.resume, trainer, state)
    return state, rows, time.perf_counter() - start, step_once.seconds


def _rule(cfg: TrainConfig):
    """The data rule the flags name (None: the trainer's default, SSGD)."""
    import pipejax as pj

    T = pj.transforms
    if cfg.rule is None or cfg.rule == "ssgd":
        return None
    if cfg.rule == "hadpsgd" or cfg.nodes > 1:
        if cfg.rule == "adpsgd":
            raise pj.errors.ConfigError("--rule adpsgd gossips over all replicas; with --nodes "
                                        "use --rule hadpsgd (or elastic, ssgd)")
        return (T.hadpsgd() if cfg.rule == "hadpsgd" else
                T.elastic("node", cfg.alpha, cfg.every, local="local"))
    return T.adpsgd() if cfg.rule == "adpsgd" else T.elastic("data", cfg.alpha, cfg.every)


def _check(cfg: TrainConfig, task) -> None:
    """The flags' combinations that cannot run, each a clear error."""
    from pipejax.errors import ConfigError

    if cfg.batch_size % (cfg.microbatches * cfg.replicas):
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by --microbatches "
                          f"{cfg.microbatches} x --replicas {cfg.replicas}")
    mb, parts = cfg.batch_size // (cfg.microbatches * cfg.replicas), cfg.microbatches * cfg.replicas
    if mb % cfg.fsdp:
        raise ConfigError(f"micro-batches of {mb} examples (--batch-size / (--microbatches x "
                          f"--replicas)) do not split over --fsdp {cfg.fsdp} devices a stage; "
                          f"use a --batch-size divisible by {parts * cfg.fsdp}")
    if cfg.save_every and cfg.resume is None:
        raise ConfigError("--save-every N writes checkpoints into --resume DIR; give the "
                          "directory")
    if task.unit == "tokens" and (not cfg.prompt or cfg.sample_length < 0
                                  or cfg.temperature < 0 or cfg.eval_windows < 1):
        raise ConfigError(
            f"--prompt {cfg.prompt!r} --sample-length {cfg.sample_length} --temperature "
            f"{cfg.temperature} --eval-windows {cfg.eval_windows}: the report's sample needs a "
            "prompt of one byte or more, a length and temperature of 0 or more, and the "
            "evaluations 1 window or more")


def _start(cfg: TrainConfig, trainer, pipe):
    """The state to train from: the latest checkpoint in --resume, else a fresh one."""
    import pipejax as pj

    if cfg.resume is not None and pj.checkpoint.latest(cfg.resume) is not None:
        state = pj.restore(cfg.resume, trainer)
        if jax.process_index() == 0:
            print(f"resumed from step {int(state.step)} ({cfg.resume})", flush=True)
        return state
    if cfg.resume is not None and jax.process_index() == 0:
        print(f"no checkpoint in {cfg.resume} yet: training from step 0, saving there",
              flush=True)
    return trainer.init(pipe.init(jax.random.key(cfg.seed)), jax.random.key(cfg.seed + 1))


def train(cfg: TrainConfig) -> int:
    """`pipejax train`: build, train, evaluate and report (see the module)."""
    import pipejax as pj

    if cfg.resume is not None:
        cfg = dataclasses.replace(cfg, resume=checkpoints_of(cfg.resume))
    mesh = setup_devices(cfg.stages, cfg.replicas, cfg.nodes, cfg.fsdp, cfg.tensor)
    task = load_task(cfg.model, cfg.data, cfg.model_kwargs().get("context"), cfg.eval_windows,
                     cfg.seed)
    _check(cfg, task)
    save_dir = cfg.out  # every process takes part in saving the checkpoint
    if jax.process_index() > 0:  # one process reports for the job
        cfg = dataclasses.replace(cfg, quiet=True, out=None, eval_every=0)
    per_epoch = task.steps_per_epoch(cfg.batch_size)
    total = cfg.steps if cfg.steps is not None else cfg.epochs * per_epoch
    if cfg.warmup_defaulted:  # a model's warm-up takes at most a tenth of a short run
        cfg = dataclasses.replace(cfg, warmup=min(cfg.warmup, total // 10))
    per_step = updates_per_step(cfg)  # a stage's updates a step
    optimizer, stash, settings = make_optimizer(
        cfg, (total * per_step, per_epoch * per_step), cfg.batch_size // per_step,
        is_synchronous(cfg))
    layers, pipe = make_pipeline(cfg, task, mesh, stash, cfg.seed)
    trainer = pipe.trainer(optimizer, _rule(cfg), clip_norm=cfg.clip,
                           skip_nonfinite=cfg.skip_nonfinite)
    memory = str(trainer.memory())
    if jax.process_index() == 0:
        print(pipe, flush=True)
        print(f"optimizer: {describe_optimizer(settings)}", flush=True)
        print(memory, flush=True)
    state = _start(cfg, trainer, pipe)
    task.bind(layers)
    first = int(state.step)
    state, rows, seconds, compile_seconds = _loop(cfg, trainer, state, task, total)
    variables = pj.unstage(state)  # gathered from every process; the replicas' mean
    rate = round((total - first) * task.items(cfg.batch_size) / seconds, 1)
    summary = {**task.evaluate(variables, final=True),
               "steps": total, "epochs": round(total / per_epoch, 2),
               "seconds": round(seconds, 1),
               "compile_seconds": None if compile_seconds is None else round(compile_seconds, 2),
               f"{task.unit}_per_s": rate,
               "model": cfg.model, "api": api_of(pipe.build.code.model.layers), "data": cfg.data,
               "schedule": cfg.schedule, "stages": cfg.stages,
               "split": list(pipe.plan.split), "virtual": pipe.plan.placement.virtual,
               "batch_size": cfg.batch_size,
               "microbatches": cfg.microbatches, **settings,
               "mitigation": cfg.mitigation or "none", "form": cfg.form,
               "horizon_scale": cfg.horizon_scale, "delays": pipe.schedule.delays,
               "replicas": cfg.replicas, "nodes": cfg.nodes, "fsdp": cfg.fsdp,
               "fsdp_gather": pipe.build.stage.gather.value, "tensor": cfg.tensor,
               "rule": trainer.rule.name if trainer.rule else "none",
               "processes": jax.process_count()}
    if save_dir:
        save_run(save_dir, cfg, trainer, state, task)
    if jax.process_index() == 0:
        finish(cfg, Run(pipe, task, layers, variables, rows, summary, memory, seconds))
    return 0
