"""Trace a layer list: shapes, parameters and cost of every layer.

First step of the data flow: `jax.eval_shape` runs through the
list with one example micro-batch, so no parameter is allocated. Each layer
gets a `LayerSpec` with its input/output shapes and dtypes, its parameter
shapes, and its cost: forward+backward FLOPs from XLA's `cost_analysis()` of
that layer alone (GPipe §2 partitions by such estimates), parameter bytes and
output activation bytes; `cost="time"` measures each layer instead.

A layer is whatever `layers.layer_list` wraps (a Flax linen or NNX module,
or a function of one array); this module only measures them, through the
`Layer` interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipejax import caches
from pipejax.errors import ConfigError, LayerError, PipejaxError
from pipejax.layers import Layer, abstract, layer_list, remembered, shapes
from pipejax.timing import median_seconds


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What tracing learned about one layer."""

    index: int
    name: str
    input: jax.ShapeDtypeStruct
    output: Any  # pytree of jax.ShapeDtypeStruct
    variables: Any  # pytree of jax.ShapeDtypeStruct (an nnx.State for NNX), {} for a function
    flops: float | None  # forward + backward operations by XLA's cost analysis; None if none
    param_bytes: int
    activation_bytes: int  # bytes of the output, one micro-batch
    random: bool = False  # its training forward reads its key (dropout)
    seconds: float | None = None  # measured forward + backward (cost="time")

    @property
    def cost(self) -> float | None:
        """The cost the partitioner balances: measured time if any, else FLOPs."""
        return self.seconds if self.seconds is not None else self.flops


def nbytes(tree: Any) -> int:
    """Bytes of a tree of arrays or `ShapeDtypeStruct`s."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _describe(tree: Any) -> str:
    return ", ".join(f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(tree))


def _fwd_bwd(layer: Layer) -> Callable:
    """Forward + backward of one layer, seeded with `ones_like` of its output."""
    def run(variables, h, key):
        out, vjp = jax.vjp(lambda v, x: layer.apply(v, x, key), variables, h)
        return out, vjp(jax.tree.map(jnp.ones_like, out))  # out too, or its work is dropped
    return run


class _KeepsState(Exception):
    """A layer keeps mutable state (BatchNorm), which the pipeline cannot."""


def _analyse(layer: Layer, h: Any, key_struct: Any, key: jax.Array) -> tuple:
    """(variables, output, whether it reads the key, FLOPs) of one layer on
    input `h`, the arrays abstract.

    Raises:
      _KeepsState: saying what the layer keeps.
    """
    # Without the shardings that values made under a mesh carry (an NNX
    # module built in `jax.set_mesh`): the pipeline places them itself.
    variables = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                             jax.eval_shape(layer.init, key_struct, h))
    # the state check first: linen's BatchNorm fails to apply without its statistics
    kept = layer.kept_state(variables, h, key_struct)
    if kept is not None:
        raise _KeepsState(kept)
    jaxpr, out = jax.make_jaxpr(layer.apply, return_shape=True)(variables, h, key_struct)
    return variables, out, _reads_key(jaxpr), _flops(layer, variables, h, key)


def _flops(layer: Layer, variables: Any, h: Any, key: jax.Array) -> float | None:
    """Operations of one forward+backward by XLA's cost analysis."""
    return xla_flops(jax.jit(_fwd_bwd(layer)).lower(variables, h, key))


def xla_flops(lowered: Any) -> float | None:
    """The operations of a lowered program by XLA's cost analysis: FLOPs plus
    transcendentals (XLA leaves out a count that is zero: a reshape has none,
    tanh only transcendentals); None when XLA gives no analysis at all."""
    # Some backends (GPU) analyse only the compiled program.
    analysis = cost_analysis(lowered) or cost_analysis(lowered.compile())
    if not analysis:
        return None
    total = float(analysis.get("flops", 0.0)) + float(analysis.get("transcendentals", 0.0))
    return total if np.isfinite(total) and total >= 0 else None  # GPU marks unknown counts < 0


def cost_analysis(program: Any) -> dict:
    """XLA's cost analysis of a lowered or compiled program as one dict
    (older jax returns one per device; empty where XLA gives none)."""
    analysis = program.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return analysis or {}


def _reads_key(jaxpr: Any) -> bool:
    """Whether a jaxpr whose last input is the key reads it."""
    key = jaxpr.jaxpr.invars[-1]
    return any(v is key for eqn in jaxpr.jaxpr.eqns for v in eqn.invars)


def trace_loss(loss: Any, output: Any, targets: Any) -> None:
    """Check that `loss(outputs, targets)` of one micro-batch is one float.

    Raises:
      LayerError: naming the shapes, when the loss fails on them or returns
        something else than a scalar.
    """
    where = f"outputs {_describe(output)} and targets {_describe(targets)}"
    try:
        out = jax.eval_shape(loss, output, targets)
    except Exception as err:  # noqa: BLE001 - re-raised with the shapes named
        hint = "" if isinstance(err, PipejaxError) else (  # a pipejax loss says how to fix it
            "; give pj.pipeline(targets=...) one micro-batch of targets shaped as the loss "
            "expects")
        leads = {np.shape(a)[0] if np.ndim(a) else None
                 for a in jax.tree.leaves((output, targets))}
        if len(leads) > 1:
            hint += (f" (outputs and targets differ in their first axis, {sorted(leads, key=str)}"
                     ": is pj.pipeline's example one micro-batch, its batch axis first?)")
        raise LayerError(
            f"the loss cannot take {where}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}{hint}") from None
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
            and jnp.issubdtype(out.dtype, jnp.floating)):
        raise LayerError(f"the loss returns {_describe(out)} for {where}; it must return one "
                         "float, the mean over the micro-batch (e.g. jnp.mean(...))")


def _seconds(layer: Layer, variables: Any, h: Any, key: jax.Array, repeats: int = 5) -> float:
    """Median wall time of one jitted forward+backward on the local device."""
    run = jax.jit(_fwd_bwd(layer))
    real_v = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), variables)
    real_h = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), h)
    return median_seconds(lambda: jax.block_until_ready(run(real_v, real_h, key)), repeats)


def trace(layers: Sequence[Layer], example: Any, cost: str = "flops",
          key: jax.Array | None = None, source: str = "the example") -> list[LayerSpec]:
    """Trace `layers` on one example micro-batch; allocates no parameters
    (except with `cost="time"`, which must run each layer to time it).
    `source` names where `example` came from, in the errors.

    Raises:
      LayerError: naming the layer index, its class and the shapes, when a
        layer cannot take its input or keeps mutable state (BatchNorm).
    """
    if cost not in ("flops", "time"):
        raise ConfigError(f"unknown cost {cost!r}; use 'flops' or 'time'")
    layers = layer_list(layers, [])  # tied weights: each layer runs on its own copy
    key = jax.random.key(0) if key is None else key
    key_struct = jax.eval_shape(lambda: key)
    h = abstract(example)
    specs = []
    timed: list = []  # cost="time": seconds measured once per kind of layer and input a call
    for i, layer in enumerate(layers):
        name = layer.name

        def failed(err: Exception) -> LayerError:
            produced = source if i == 0 else f"layer {i - 1} ({specs[-1].name})"
            first_line = str(err).splitlines()[0].rstrip(".") if str(err) else ""
            return LayerError(
                f"layer {i} ({name}){layer.detail} cannot take input {_describe(h)} produced by "
                f"{produced}: {type(err).__name__}: {first_line}; "
                "check the shapes of this layer and the layer before it")

        kind = shapes(h)
        try:
            variables, out, random, flops = remembered(
                caches.ANALYSES, [layer], kind, lambda: _analyse(layer, h, key_struct, key))
        except _KeepsState as state:
            raise LayerError(f"layer {i} ({name}) {state}") from None
        except Exception as err:  # noqa: BLE001 - re-raised with the layer named
            raise failed(err) from None
        seconds = (remembered(timed, [layer], kind, lambda: _seconds(layer, variables, h, key))
                   if cost == "time" else None)
        specs.append(LayerSpec(index=i, name=name, input=h, output=out, variables=variables,
                               flops=flops, param_bytes=nbytes(variables),
                               activation_bytes=nbytes(out), random=random,
                               seconds=seconds))
        h = out
    return specs
