"""What a row of the cores benchmark (bench/cores.py) runs: its models
(`models`), each with its micro-batch, data, loss and optimizer, and the
calls that run one step of the plain jit or of a row's trainer and wait."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of the benchmark: its layers, one micro-batch's size, its data
    (a batch of M micro-batches), loss and optimizer."""

    layers: Callable[[], list]
    micro: int
    batch: Callable[[int], tuple]
    loss: str
    optimizer: Callable[[], object]


def _gpt_batch(n: int) -> tuple:
    import jax
    import jax.numpy as jnp

    x = jax.random.randint(jax.random.key(0), (n, 128), 0, 256)
    return x, jnp.roll(x, -1, axis=1)


def _mlp_batch(n: int) -> tuple:
    import jax

    x = jax.random.normal(jax.random.key(0), (n, 64))
    return x, jax.random.randint(jax.random.key(1), (n,), 0, 10)


def models() -> dict[str, Model]:
    """The benchmark's models by name: the zoo GPT 6x128 (4 heads, context
    128) and the MLP 8x512 on 64 inputs (their layers are built when called)."""
    import optax

    import pipejax as pj

    return {"gpt": Model(lambda: pj.models.gpt(depth=6, width=128, heads=4, context=128), 4,
                         _gpt_batch, "next_token", lambda: optax.adamw(1e-3)),
            "mlp": Model(lambda: pj.models.mlp(depth=8, width=512, classes=10), 256,
                         _mlp_batch, "cross_entropy", lambda: optax.sgd(1e-2, momentum=0.9))}


def plain(model: Model, M: int, device):
    """The plain jit's step on `device`, as a call that runs it once and waits."""
    import jax

    import pipejax as pj
    from pipejax.bench.speed import plain_steps
    from pipejax.layers import initial_variables

    layers, (x, y), opt = model.layers(), model.batch(M * model.micro), model.optimizer()
    step = jax.jit(plain_steps(layers, M, opt, ("plain_microbatched",),
                               getattr(pj.losses, model.loss))["plain_microbatched"])
    v = initial_variables(layers, x[:model.micro], jax.random.key(0))
    state = jax.device_put([v, opt.init(v), x, y], device)

    def run():
        state[0], state[1], loss = step(*state)
        jax.block_until_ready(loss)
    return run


def trainer(model: Model, row: dict):
    """The row's pipeline and a call that runs its trainer's step once and waits."""
    import jax

    import pipejax as pj
    from pipejax.timing import stepper

    layers, (x, y) = model.layers(), model.batch(row["M"] * model.micro)
    pipe = pj.pipeline(layers, loss=getattr(pj.losses, model.loss), example=x[:model.micro],
                       targets=y[:model.micro], stages=row["K"], microbatches=row["M"],
                       schedule=row["schedule"], remat=row["remat"], mesh=pj.make_mesh(row["K"]))
    trainer = pipe.trainer(model.optimizer())
    return pipe, stepper(trainer, trainer.init(pipe.init(jax.random.key(0))), (x, y))
