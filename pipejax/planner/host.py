"""This machine's rates, measured (`pipejax plan --search --machine host`):
the `Machine` of N simulated devices that share its processor.

Each rate is measured apart from any candidate, on N devices:
  - the processor's rate: a plain data-parallel jit of a GPT's gradient,
    its batch split over the devices, past its layers' fixed cost;
  - a layer's fixed cost: the GPT at K = 1 on the devices as replicas, its
    batch in 1 and in 16 micro-batches (the same FLOPs, 15 more passes of
    every layer's forward and backward, three forwards' worth as
    `costs.fixed_costs` counts them);
  - a tick's fixed cost: a 4-stage 1F1B step of layers of width 4, whose
    arithmetic is nothing;
  - the link: the copy rate of a 64 MB array;
  - the memory as the rings use it (`ring_rate`).
`benchmarks/planner.py --part time` measures with these and reports how the
predicted steps of a GPT's candidates rank against the timed ones.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipejax import losses, models
from pipejax.compile import unstage
from pipejax.errors import DeviceError
from pipejax.layers import apply_layers
from pipejax.mesh import DATA, make_mesh
from pipejax.pipeline import pipeline
from pipejax.planner.machine import Machine
from pipejax.timing import alternate, median_seconds, stepper
from pipejax.trace import trace

GPT = dict(depth=6, width=64, heads=4, context=32)  # the model the rates are measured on
REPEATS = 5


def measure(devices: int) -> Machine:
    """The `Machine` of this processor's `devices` simulated devices."""
    if len(jax.devices()) < devices:
        raise DeviceError(f"--machine host measures {devices} devices but JAX sees "
                          f"{len(jax.devices())}; simulate them first (pj.simulate_devices)")
    plain, flops = plain_gradient(devices)
    layer = layer_seconds(devices)
    host = rate(flops, median_seconds(plain, REPEATS), layer, devices)
    return Machine(host, link_bandwidth(), tick_seconds(), host, ring_rate(devices), layer,
                   devices=devices)


def batch(devices: int) -> int:
    """The GPT's batch on `devices`: one example a micro-batch at M = 16."""
    return 16 * devices


def gpt_batch(n: int) -> tuple[jax.Array, jax.Array]:
    """n windows of random tokens and their next tokens."""
    tokens = jax.random.randint(jax.random.key(1), (n, GPT["context"] + 1), 0, 256)
    return tokens[:, :-1], tokens[:, 1:]


def _data_split(devices: int) -> jax.sharding.NamedSharding:
    """The batch axis over the first `devices` devices."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:devices]), (DATA,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(DATA))


def plain_gradient(devices: int) -> tuple[Callable[[], None], float]:
    """The processor's rate as the devices share it: a plain data-parallel
    jit of the GPT's gradient, the batch split over the devices; the call
    and its FLOPs."""
    layers, n = models.gpt(**GPT), batch(devices)
    x, y = gpt_batch(n)
    variables = unstage(pipeline(layers, loss=losses.next_token, example=x, targets=y,
                                 stages=1, microbatches=1).init(jax.random.key(0)))
    split = _data_split(devices)
    xs, ys = jax.device_put(x, split), jax.device_put(y, split)
    grad = jax.jit(jax.grad(lambda v, x, y: losses.next_token(apply_layers(layers, v, x), y)))
    return lambda: jax.block_until_ready(grad(variables, xs, ys)), gradient_flops(devices)


def gradient_flops(devices: int) -> float:
    """The traced FLOPs of the GPT's gradient over its batch on `devices`."""
    x, _ = gpt_batch(batch(devices))
    return batch(devices) * sum(s.flops for s in trace(models.gpt(**GPT), x[:1]))


def layer_seconds(devices: int) -> float:
    """A layer's forward's fixed seconds (`Machine.layer_seconds`): the GPT's
    pipelined step at K = 1 on the devices as replicas, the batch in M = 1
    and in M = 16 micro-batches (alternated): the same FLOPs, 15 more runs
    of every layer's forward and backward (three forwards' worth) on each."""
    layers, n = models.gpt(**GPT), batch(devices)
    x, y = gpt_batch(n)
    runs = {}
    for M in (1, 16):
        mb = n // devices // M
        pipe = pipeline(layers, loss=losses.next_token, example=x[:mb], targets=y[:mb],
                        stages=1, microbatches=M, mesh=make_mesh(1, data=devices))
        trainer = pipe.trainer(optax.adam(1e-3))
        runs[M] = stepper(trainer, trainer.init(pipe.init(jax.random.key(0))), (x, y))
    times = alternate(runs, 3 * REPEATS)
    more = float(np.median(times[16] - times[1]))
    if more <= 0:
        raise DeviceError(f"16 micro-batches were no slower than 1 ({more * 1e3:.1f} ms): the "
                          "machine is too loaded to measure a layer's fixed cost; run again")
    return more / (15 * 3 * len(layers) * devices)


def rate(flops: float, seconds: float, layer: float, devices: int) -> float:
    """The processor's rate from the plain gradient's FLOPs and time, past
    its layers' fixed cost (every layer's forward and backward on each
    device, as `layer_seconds` counts them)."""
    return flops / (seconds - layer * devices * 3 * len(models.gpt(**GPT)))


def tick_seconds() -> float:
    """A tick's fixed cost: a 4-stage 1F1B step of layers of width 4."""
    tiny = pipeline(models.mlp(depth=7, width=4), loss=losses.cross_entropy,
                    example=jnp.zeros((1, 4)), stages=4, microbatches=16, schedule="1f1b")
    trainer = tiny.trainer(optax.sgd(0.1))
    step = stepper(trainer, trainer.init(tiny.init(jax.random.key(0))),
                   (jnp.zeros((16, 4)), jnp.zeros((16,), jnp.int32)))
    return median_seconds(step, REPEATS) / tiny.schedule.ticks


def link_bandwidth() -> float:
    """Bytes a second of a 64 MB copy: a message between simulated devices."""
    big = jnp.ones((2**24,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0)
    return big.nbytes / median_seconds(lambda: jax.block_until_ready(copy(big)), REPEATS)


def ring_rate(devices: int, rows: int = 4, trips: int = 32) -> float:
    """The memory's byte rate as the rings use it (`costs.ring_costs`
    counts a value's bytes once written, once read): on each device a scan
    whose every trip makes an activation with a matmul (16384 x 64, 4 MB,
    a ring of 16 MB: past the caches, as a GPT's rings are) and takes it
    into two more, either where it is made or through a ring of `rows`
    rows (written into one, the one written `rows` − 1 trips before read
    back), both alternated; twice the bytes through the ring over the
    median of the rounds' differences."""
    n, d = 16384, 64
    split = _data_split(devices)
    w = jnp.full((d, d), 0.01)
    x = jax.device_put(jnp.ones((devices, n, d)), split)
    ring_split = jax.sharding.NamedSharding(split.mesh, jax.sharding.PartitionSpec(None, DATA))

    def steps(through: bool):
        def body(carry, i):
            c, ring = carry
            y = jnp.tanh(jnp.einsum("bnd,de->bne", c, w))
            if through:
                ring = jax.lax.dynamic_update_slice(ring, y[None], (i % rows, 0, 0, 0))
                y = jax.lax.dynamic_index_in_dim(ring, (i + 1) % rows, keepdims=False)
            g = jnp.einsum("bnd,bne->bde", y, c)
            return (c + 1e-3 * jnp.einsum("bnd,bde->bne", c, g), ring), None

        def run(x):
            ring = jax.lax.with_sharding_constraint(jnp.zeros((rows, *x.shape)), ring_split)
            return jax.lax.scan(body, (x, ring), jnp.arange(trips))[0][0]
        f = jax.jit(run)
        return lambda: jax.block_until_ready(f(x))

    times = alternate({"hot": steps(False), "ring": steps(True)}, 3 * REPEATS)
    extra = float(np.median(times["ring"] - times["hot"]))
    if extra <= 0:
        raise DeviceError(f"the ring was no slower than the hot path ({extra * 1e3:.1f} ms): "
                          "the machine is too loaded to measure its memory; run again")
    return 2 * trips * x.nbytes / extra
