"""Trace a layer list: shapes, parameters and cost of every layer.

First step of the data flow: `jax.eval_shape` runs through the
list with one example micro-batch, so no parameter is allocated. Each layer
gets a `LayerSpec` with its input/output shapes and dtypes, its parameter
shapes, and its cost: forward+backward FLOPs from XLA's `cost_analysis()` of
that layer alone (GPipe §2 partitions by such estimates), parameter bytes and
output activation bytes; `cost="time"` measures each layer instead.

A layer is a Flax linen module (`layer.init` / `layer.apply`), a Flax NNX
module (split once into an `NnxLayer`, nnx_layer.py) or a plain function of
one array (`nn.relu`, `jnp.tanh`, a flatten lambda); `layer_list` turns a
user's list (or `nnx.Sequential`) into these.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pipejax.errors import ConfigError, LayerError
from pipejax.nnx_layer import NnxLayer, describe, layer_list

Layer = Any  # a flax.linen.Module, an NnxLayer or a callable of one array
Variables = Any  # linen: what `layer.apply` takes; NNX: an nnx.State of its Params; {}: a function


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


def layer_name(layer: Layer) -> str:
    """A short readable name: the module class, or the function's name."""
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    if isinstance(layer, NnxLayer):
        return layer.name
    name = getattr(layer, "__name__", None) or type(layer).__name__
    return "lambda" if name == "<lambda>" else name


def _call_kwargs(layer: nn.Module, train: bool) -> dict:
    """`deterministic=` / `train=` for modules whose `__call__` takes them.

    A module that fixed `deterministic` at construction is left alone (Flax
    rejects the flag given twice).
    """
    params = inspect.signature(type(layer).__call__).parameters
    kwargs = {}
    if "deterministic" in params and getattr(layer, "deterministic", None) is None:
        kwargs["deterministic"] = not train
    if "train" in params and getattr(layer, "train", None) is None:
        kwargs["train"] = train
    return kwargs


def same_layer(a: Layer, b: Layer) -> bool:
    """Whether two layers are one function of (variables, input): the same
    object, or equal Flax modules of one class (`nn.Dense(64) == nn.Dense(64)`).
    Distinct function objects count as different, even with equal code."""
    if a is b:
        return True
    if isinstance(a, NnxLayer) and isinstance(b, NnxLayer):
        return a.same(b)
    if not (isinstance(a, nn.Module) and type(a) is type(b)):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - fields that do not compare (arrays): not provably equal
        return False


def shapes(tree: Any) -> tuple:
    """A tree's structure with the shape and dtype of every leaf, comparable with ==."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)


def init_layer(layer: Layer, key: jax.Array, h: Any) -> Variables:
    """Initial variables of one layer for input `h` ({} for a function); an
    NNX layer arrives initialized: its current parameters."""
    if isinstance(layer, NnxLayer):
        return layer.values()
    if not isinstance(layer, nn.Module):
        return {}
    variables = layer.init({"params": key, "dropout": key}, h, **_call_kwargs(layer, False))
    return dict(variables)


def apply_layer(layer: Layer, variables: Variables, h: Any, key: jax.Array | None = None,
                train: bool = True) -> Any:
    """Run one layer. `key` feeds the 'dropout' stream when training (an NNX
    layer's streams, by `stream_keys`)."""
    if isinstance(layer, NnxLayer):
        return layer.apply(variables, h, key, train)
    if not isinstance(layer, nn.Module):
        return layer(h)
    rngs = {"dropout": key} if (train and key is not None) else None
    return layer.apply(variables, h, rngs=rngs, **_call_kwargs(layer, train))


def layer_key(key: jax.Array, index: int) -> jax.Array:
    """The key of layer `index` (global position in the list) for one micro-batch."""
    return jax.random.fold_in(key, index)


def apply_layers(layers: Sequence[Layer], variables: Sequence[Variables], h: Any,
                 key: jax.Array | None = None, train: bool = True, first: int = 0) -> Any:
    """Run a contiguous run of layers sequentially; `first` is the global index
    of `layers[0]`, so keys match however the list is split into stages.
    `layers` may be the user's list (NNX modules are split here)."""
    for i, (layer, v) in enumerate(zip(layer_list(layers), variables)):
        k = None if key is None else layer_key(key, first + i)
        h = apply_layer(layer, v, h, k, train)
    return h


def nbytes(tree: Any) -> int:
    """Bytes of a tree of arrays or `ShapeDtypeStruct`s."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def _describe(tree: Any) -> str:
    return ", ".join(f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(tree))


def _check_writes(i: int, layer: NnxLayer, variables: Any, h: Any, key: Any) -> None:
    """Reject an NNX layer whose training forward writes a variable: the
    pipeline would drop the write (a stateless stage), a silent wrong answer."""
    written = layer.written(variables, h, key)
    if written:
        raise LayerError(
            f"layer {i} ({layer.name}) writes {', '.join(written)} in its forward (BatchNorm "
            "statistics, a cache, sown intermediates?); pipelines train stateless layers only: "
            "use nnx.GroupNorm or nnx.LayerNorm, or fix the statistics "
            "(nnx.BatchNorm(..., use_running_average=True) only reads them)")


def _fwd_bwd(layer: Layer) -> Callable:
    """Forward + backward of one layer, seeded with `ones_like` of its output."""
    def run(variables, h, key):
        out, vjp = jax.vjp(lambda v, x: apply_layer(layer, v, x, key), variables, h)
        return out, vjp(jax.tree.map(jnp.ones_like, out))  # out too, or its work is dropped
    return run


def _flops(layer: Layer, variables: Any, h: Any, key: jax.Array) -> float | None:
    """Operations of one forward+backward by XLA's cost analysis: FLOPs plus
    transcendentals (XLA leaves out a count that is zero: a reshape has none,
    tanh only transcendentals); None when XLA gives no analysis at all."""
    lowered = jax.jit(_fwd_bwd(layer)).lower(variables, h, key)
    analysis = _first(lowered.cost_analysis())
    if not analysis:  # some backends (GPU) analyse only the compiled program
        analysis = _first(lowered.compile().cost_analysis())
    if not analysis:
        return None
    total = float(analysis.get("flops", 0.0)) + float(analysis.get("transcendentals", 0.0))
    return total if np.isfinite(total) and total >= 0 else None  # GPU marks unknown counts < 0


def _first(analysis: Any) -> dict | None:
    """A cost analysis as one dict (older jax returns one per device)."""
    if isinstance(analysis, (list, tuple)):
        return analysis[0] if analysis else None
    return analysis


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
        raise LayerError(
            f"the loss cannot take {where}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}; give pj.pipeline(targets=...) one "
            "micro-batch of targets shaped as the loss expects") from None
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == ()
            and jnp.issubdtype(out.dtype, jnp.floating)):
        raise LayerError(f"the loss returns {_describe(out)} for {where}; it must return one "
                         "float, the mean over the micro-batch (e.g. jnp.mean(...))")


def _seconds(layer: Layer, variables: Any, h: Any, key: jax.Array, repeats: int = 5) -> float:
    """Median wall time of one jitted forward+backward on the local device."""
    run = jax.jit(_fwd_bwd(layer))
    real_v = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), variables)
    real_h = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), h)
    jax.block_until_ready(run(real_v, real_h, key))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(real_v, real_h, key))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def trace(layers: Sequence[Layer], example: Any, cost: str = "flops",
          key: jax.Array | None = None) -> list[LayerSpec]:
    """Trace `layers` on one example micro-batch; allocates no parameters
    (except with `cost="time"`, which must run each layer to time it).

    Raises:
      LayerError: naming the layer index, its class and the shapes, when a
        layer cannot take its input or keeps mutable state (BatchNorm).
    """
    if cost not in ("flops", "time"):
        raise ConfigError(f"unknown cost {cost!r}; use 'flops' or 'time'")
    layers = layer_list(layers)
    key = jax.random.key(0) if key is None else key
    key_struct = jax.eval_shape(lambda: key)
    h = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), example)
    specs = []
    costs: list[tuple[Layer, tuple, float | None, float | None]] = []  # measured once per kind
    for i, layer in enumerate(layers):
        name = layer_name(layer)
        if not (isinstance(layer, (nn.Module, NnxLayer)) or callable(layer)):
            raise LayerError(f"layer {i} ({name}) is neither a Flax module nor a callable; "
                             "a layer list holds Flax modules (linen or NNX) or functions of "
                             "one array")
        def failed(err: Exception) -> LayerError:
            produced = "the example" if i == 0 else f"layer {i - 1} ({specs[-1].name})"
            holds = (f" (its parameters: {describe(layer.abstract)})"
                     if isinstance(layer, NnxLayer) else "")
            return LayerError(
                f"layer {i} ({name}){holds} cannot take input {_describe(h)} produced by {produced}: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; "
                "check the shapes of this layer and the layer before it")

        try:
            variables = jax.eval_shape(lambda k, x: init_layer(layer, k, x), key_struct, h)
        except Exception as err:  # noqa: BLE001 - re-raised with the layer named
            raise failed(err) from None
        extra = [] if isinstance(layer, NnxLayer) else sorted(set(variables) - {"params"})
        if extra:
            raise LayerError(
                f"layer {i} ({name}) keeps mutable collections {extra} (BatchNorm statistics?); "
                "pipelines train stateless layers only: use GroupNorm or LayerNorm instead")
        try:
            jaxpr, out = jax.make_jaxpr(lambda v, x, k: apply_layer(layer, v, x, k),
                                        return_shape=True)(variables, h, key_struct)
        except Exception as err:  # noqa: BLE001 - re-raised with the layer named
            raise failed(err) from None
        if isinstance(layer, NnxLayer):
            _check_writes(i, layer, variables, h, key_struct)
        kind = shapes(h)
        known = next((c for c in costs if c[1] == kind and same_layer(c[0], layer)), None)
        if known is None:  # equal layers on equal shapes cost the same: measure one
            known = (layer, kind, _flops(layer, variables, h, key),
                     _seconds(layer, variables, h, key) if cost == "time" else None)
            costs.append(known)
        flops, seconds = known[2:]
        specs.append(LayerSpec(index=i, name=name, input=h, output=out, variables=variables,
                               flops=flops, param_bytes=nbytes(variables),
                               activation_bytes=nbytes(out), random=_reads_key(jaxpr),
                               seconds=seconds))
        h = out
    return specs
