"""Flax NNX modules as layers of a list: split once, merged inside each stage.

An NNX module holds its variables; a pipeline needs a pure function of
(variables, input) that each stage's branch runs on its own slots. Following
Flax's functional API ("use nnx.split and
nnx.merge when crossing a JAX transform", as MaxText's `NNXPipeline` does
inside its scan), each module of the list is split ONCE, when the list is
given, with `nnx.split(module, nnx.Param, nnx.RngState, ...)`:

- the graphdef is static: the layer's code, compared to share stage branches;
- the `nnx.Param` state is the layer's variables: traced, packed, trained and
  returned by `pj.unstage` as an `nnx.State`, so `nnx.update` / `nnx.merge`
  take it back (`pj.unstage(state, into=model)` does it);
- the random streams (`nnx.RngState`) are reseeded before every call from the
  pipeline's key, so a pipelined run equals a sequential one deriving keys
  the same way (`stream_keys`);
- any other variable (`nnx.BatchStat`, a buffer) is a constant of the
  compiled step, taken when the list is given, if the forward only reads it;
  a layer whose forward writes one is rejected (`written`), as linen's
  mutable collections are.

Inside a branch `nnx.merge(..., copy=True)` builds a throwaway module from the
branch's own parameters, so the user's module is never written while tracing.
The parameters a pipeline starts from are the module's current values
(`values`), read when `pipe.init` is called.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from pipejax.errors import LayerError


_SHARED = ("a pipeline places each layer's parameters on one stage and would train two copies "
           "where Flax trains one (tied weights, such as input and output embeddings, cannot "
           "cross stages): give each layer its own module, or put the layers that share weights "
           "into one layer")


def stream_keys(key: jax.Array, streams: Sequence[str]) -> dict[str, jax.Array]:
    """The key of each random stream of one layer call: stream `s` gets
    `fold_in(key, crc32(s))`, where `key` is the layer's key for the
    micro-batch (`fold_in(fold_in(step_key, m), i)`, as for linen layers).
    A sequential run that reseeds each layer with `nnx.reseed(layer,
    **stream_keys(key_i, streams))` before calling it draws the same numbers."""
    return {s: jax.random.fold_in(key, zlib.crc32(s.encode()) & 0x7FFFFFFF) for s in streams}


class NnxLayer:
    """One NNX module of a layer list, split into graphdef, parameters,
    random streams and constants (module docstring)."""

    def __init__(self, module: nnx.Module):
        self.module = module
        self.graphdef, params, rngs, constants = nnx.split(module, nnx.Param, nnx.RngState, ...)
        # nnx.split hands out the module's own Variables: keep new ones holding
        # today's values, so a later nnx.update of the module changes nothing here.
        self.rngs, self.constants = _copy(rngs), _copy(constants)
        self.streams = tuple(sorted({v.tag for _, v in nnx.to_flat_state(self.rngs)
                                     if isinstance(v, nnx.RngKey)}))
        self.abstract = _abstract(params)

    @property
    def name(self) -> str:
        return type(self.module).__name__

    @property
    def dtype(self) -> Any:
        """The module's own computation `dtype` (None: as its inputs)."""
        return getattr(self.module, "dtype", None)

    def values(self) -> nnx.State:
        """The module's current parameters, as `nnx.state(module, nnx.Param)`."""
        return nnx.state(self.module, nnx.Param)

    def apply(self, params: nnx.State, h: Any, key: jax.Array | None, train: bool) -> Any:
        """The module's output for input `h` with parameters `params`; when
        training with a `key`, its streams are reseeded by `stream_keys`;
        `train=False` calls it in `.eval()` mode (no dropout, BatchNorm on
        its running statistics)."""
        return self._module(params, self.constants, key, train)(h)

    def _module(self, params: nnx.State, constants: nnx.State, key: jax.Array | None,
                train: bool) -> nnx.Module:
        """A throwaway module of this graphdef on `params` (copies: the
        user's module and its variables are never written)."""
        module = nnx.merge(self.graphdef, params, self.rngs, constants, copy=True)
        if train and key is not None and self.streams:
            # match_shape: a stream split over a scan of layers (nnx.split_rngs) gets
            # one key per layer, drawn from its stream's key.
            nnx.reseed(module, policy="match_shape", **stream_keys(key, self.streams))
        if not train:
            module.eval()
        return module

    def written(self, params: Any, h: Any, key: Any) -> list[str]:
        """The variables (other than its random streams' counters) that a
        training forward of the module writes or creates, as `Type path`
        strings; [] when it only reads them. Traced, never run."""
        def run(params, constants, h, key):
            module = self._module(params, constants, key, True)
            module(h)
            _, params, _, constants = nnx.split(module, nnx.Param, nnx.RngState, ...)
            return params, constants

        before = (params, self.constants)
        closed, after = jax.make_jaxpr(run, return_shape=True)(*before, h, key)
        if jax.tree.structure(after) != jax.tree.structure(before):
            paths = lambda states: {f"{type(v).__name__} {_path(p)}" for state in states
                                    for p, v in nnx.to_flat_state(state)}
            return sorted(paths(after) - paths(before)) or ["variables (their structure changes)"]
        # One name per leaf, in the order the jaxpr takes and returns them.
        names = [f"{type(v).__name__} {_path(p)}" for state in before
                 for p, v in nnx.to_flat_state(state) for _ in jax.tree.leaves(v)]
        ins = closed.jaxpr.invars[:len(names)]
        return sorted({name for name, i, o in zip(names, ins, closed.jaxpr.outvars) if o is not i})

    def same(self, other: "NnxLayer") -> bool:
        """Whether two NNX layers are one function of (parameters, input):
        equal graphdefs and streams, and no constants (or the same ones)."""
        if self is other:
            return True
        try:
            same_code = self.graphdef == other.graphdef and self.streams == other.streams
        except Exception:  # noqa: BLE001 - static fields that do not compare: not provably equal
            return False
        mine, theirs = jax.tree.leaves(self.constants), jax.tree.leaves(other.constants)
        return bool(same_code and len(mine) == len(theirs)
                    and all(a is b for a, b in zip(mine, theirs)))


def _copy(state: nnx.State) -> nnx.State:
    """The same values in new Variables."""
    return jax.tree.map(lambda a: a, state)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _items(layers: Any) -> list | None:
    """The entries of a list, tuple, `nnx.Sequential` or `nnx.List`; None for anything else."""
    layers = layers.layers if isinstance(layers, nnx.Sequential) else layers
    return list(layers) if isinstance(layers, (list, tuple, nnx.List)) else None


def layer_list(layers: Any) -> tuple:
    """The layers of `layers` (a list or tuple, an `nnx.Sequential` or an
    `nnx.List`) with each NNX module split into an `NnxLayer`.

    Raises:
      LayerError: naming the layers, when one is an NNX class rather than an
        instance, holds abstract parameters (built under `nnx.eval_shape`),
        or shares variables with another layer (the same NNX module twice, a
        linen module held inside one layer and used by another: tied
        weights): a pipeline places each layer's parameters on one stage.
    """
    items = _items(layers)
    if items is None:
        raise LayerError(f"layers must be a list of Flax modules or functions (or an "
                         f"nnx.Sequential), not {type(layers).__name__}; a model is a list so it "
                         "can be split")
    layers = items
    out, owner = [], {}
    for i, layer in enumerate(layers):
        if isinstance(layer, nnx.Module) and id(layer) in owner:
            j = owner[id(layer)]
            raise LayerError(
                f"layers {j} and {i} ({type(layer).__name__}) are one module object; {_SHARED}")
        if isinstance(layer, type) and issubclass(layer, (nnx.Module,)):
            raise LayerError(f"layer {i} is the class {layer.__name__}, not a module; give an "
                             f"instance, e.g. {layer.__name__}(..., rngs=nnx.Rngs(0))")
        if not isinstance(layer, nnx.Module):
            _own_linen_submodules(layers, i, owner)
            out.append(layer)
            continue
        name = type(layer).__name__
        for path, node in nnx.iter_graph(layer):
            # Random streams may be shared: they are reseeded at every call, never trained.
            if not isinstance(node, (nnx.Variable, nnx.Module)) or isinstance(node, nnx.RngState):
                continue
            j = owner.setdefault(id(node), i)
            if j != i:
                what = ".".join(map(str, path)) or "the whole module"
                raise LayerError(
                    f"layers {j} ({type(layers[j]).__name__}) and {i} ({name}) share {what} "
                    f"({type(node).__name__}); {_SHARED}")
        split = NnxLayer(layer)
        abstract = [f"{_path(p)}" for p, v in nnx.to_flat_state(split.values())
                    if not isinstance(v.get_value(), (jax.Array, np.ndarray))]
        if abstract:
            raise LayerError(f"layer {i} ({name}) holds abstract parameters ({', '.join(abstract)}"
                             ": no values); build it with real values, e.g. "
                             f"{name}(..., rngs=nnx.Rngs(0)), not under nnx.eval_shape")
        out.append(split)
    return tuple(out)


def _own_linen_submodules(layers: Sequence[Any], i: int, owner: dict) -> None:
    """Record the linen modules held in layer `i`'s fields (at any depth) as
    layer i's; one already held by, or listed as, another layer is shared.

    Linen would train such a module's parameters once (tied input and output
    embeddings); a pipeline would give each layer its own copy, silently. A
    linen module listed twice at the top is two layers, as before.
    """
    def walk(value: Any, path: str):
        if isinstance(value, nn.Module):
            yield path, value
            for field in dataclasses.fields(value):
                if field.name not in ("parent", "name"):
                    yield from walk(getattr(value, field.name, None), f"{path}.{field.name}")
        elif isinstance(value, (list, tuple)):
            for j, item in enumerate(value):
                yield from walk(item, f"{path}[{j}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{path}[{key!r}]")

    top = {}
    for j, layer in enumerate(layers):
        top.setdefault(id(layer), j)
    if not isinstance(layers[i], nn.Module) or top[id(layers[i])] != i:
        return  # a function, or a layer listed again: its copy was walked
    for path, module in list(walk(layers[i], ""))[1:]:
        j = owner.setdefault(id(module), i)
        j = top.get(id(module), j) if j == i else j
        if j != i:
            raise LayerError(
                f"layers {j} ({type(layers[j]).__name__}) and {i} ({type(layers[i]).__name__}) "
                f"share the module {type(module).__name__} (layer {i}'s field {path[1:]}); "
                f"{_SHARED}")


def write_into(values: Sequence[Any], into: Any) -> None:
    """`nnx.update` each NNX module of `into` (a list, `nnx.Sequential` or
    `nnx.List` of the layers a pipeline was given, or `pipe.layers`) with its entry of
    `values` (one per layer, as `pj.unstage` returns them).

    Raises:
      LayerError: when `into` has another number of layers, or an NNX
        module whose parameters differ in structure or shape from its values.
    """
    modules = _items(into)
    if modules is None or len(modules) != len(values):
        got = "not a list" if modules is None else f"{len(modules)} layers"
        raise LayerError(f"unstage(..., into=...) takes the layer list the pipeline was given "
                         f"({len(values)} layers), got {got}")
    for i, (module, v) in enumerate(zip(modules, values)):
        module = module.module if isinstance(module, NnxLayer) else module  # pipe.layers
        if not isinstance(module, nnx.Module):
            continue
        mine, theirs = _abstract(nnx.state(module, nnx.Param)), _abstract(v)
        if jax.tree.structure(mine) != jax.tree.structure(theirs) or mine != theirs:
            raise LayerError(f"layer {i} ({type(module).__name__}) has parameters "
                             f"{{{describe(mine)}}} but the values hold {{{describe(theirs)}}}; "
                             "write into the layer list the pipeline was given")
        nnx.update(module, v)


def describe(state: Any) -> str:
    """'bias float32[16], kernel float32[30, 16]': an nnx.State's variables
    (arrays or ShapeDtypeStructs) by path."""
    flat = nnx.to_flat_state(state) if isinstance(state, nnx.State) else []
    return ", ".join(f"{_path(p)} {v.get_value().dtype}{list(v.get_value().shape)}"
                     for p, v in flat)
