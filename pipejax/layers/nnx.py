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
(`values`), read when `pipe.init` is called. `wrap` rejects a module the
pipeline cannot own alone (shared variables, abstract parameters);
`write_into` puts trained values back into the user's modules.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from pipejax.errors import LayerError
from pipejax.layers.base import SHARED, Decoder, Layer, Variables
from pipejax.layers.decoding import cache_decoder


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
        self.name = type(module).__name__  # the module's class
        self.dtype = getattr(module, "dtype", None)  # its computation dtype (None: its inputs')
        self._decodes = callable(getattr(module, "init_cache", None))

    @property
    def source(self) -> nnx.Module:
        """The NNX module."""
        return self.module

    def without_values(self) -> NnxLayer:
        """This layer without its module, which holds the parameters: its
        graphdef, streams and constants, all that its `apply` and `decoder`
        read, which a process-wide memory may keep (its `source` and
        `values` are gone)."""
        light = copy.copy(self)
        light.module = None
        return light

    @property
    def detail(self) -> str:
        """The parameters it arrives with: ' (its parameters: kernel float32[30, 16], ...)'."""
        return f" (its parameters: {describe(self.abstract)})"

    def values(self) -> nnx.State:
        """The module's current parameters, as `nnx.state(module, nnx.Param)`."""
        return nnx.state(self.module, nnx.Param)

    def init(self, key: jax.Array, x: Any) -> Variables:
        """The module's current parameters: it arrives initialized (`key`, `x` unused)."""
        return self.values()

    def initial_values(self) -> nnx.State:
        """The module's current parameters, what a pipeline starts from."""
        return self.values()

    def apply(self, variables: nnx.State, x: Any, key: jax.Array | None = None,
              train: bool = True) -> Any:
        """The module's output for input `x` with parameters `variables`; when
        training with a `key`, its streams are reseeded by `stream_keys`;
        `train=False` calls it in `.eval()` mode (no dropout, BatchNorm on
        its running statistics)."""
        return self._module(variables, self.constants, key, train)(x)

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

    def kept_state(self, variables: Any, x: Any, key: Any) -> str | None:
        """The variables its training forward writes (`written`), rejected: a
        pipeline would drop the write (a stateless stage), a silent wrong answer."""
        written = self.written(variables, x, key)
        if not written:
            return None
        return (f"writes {', '.join(written)} in its forward (BatchNorm statistics, a cache, "
                "sown intermediates?); pipelines train stateless layers only: use nnx.GroupNorm "
                "or nnx.LayerNorm, or fix the statistics (nnx.BatchNorm(..., "
                "use_running_average=True) only reads them)")

    def same(self, other: Layer) -> bool:
        """Whether two NNX layers are one function of (parameters, input):
        equal graphdefs and streams, and no constants (or the same ones)."""
        if self is other:
            return True
        if not isinstance(other, NnxLayer):
            return False
        try:
            same_code = self.graphdef == other.graphdef and self.streams == other.streams
        except Exception:  # noqa: BLE001 - static fields that do not compare: not provably equal
            return False
        mine, theirs = jax.tree.leaves(self.constants), jax.tree.leaves(other.constants)
        return bool(same_code and len(mine) == len(theirs)
                    and all(a is b for a, b in zip(mine, theirs)))

    def decoder(self) -> Decoder | None:
        """nnx.MultiHeadAttention's convention, for a module with
        `init_cache(input_shape, dtype)` (decoding.py); None without it."""
        if not self._decodes:
            return None
        return cache_decoder(self._module, self.rngs, self.constants)


def _copy(state: nnx.State) -> nnx.State:
    """The same values in new Variables."""
    return jax.tree.map(lambda a: a, state)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def items(layers: Any) -> list | None:
    """The entries of a list, tuple, `nnx.Sequential` or `nnx.List`; None for anything else."""
    layers = layers.layers if isinstance(layers, nnx.Sequential) else layers
    return list(layers) if isinstance(layers, (list, tuple, nnx.List)) else None


def is_nnx(obj: Any) -> bool:
    """Whether `obj` is an NNX module, or an NNX module class (an error `wrap` names)."""
    return isinstance(obj, nnx.Module) or (isinstance(obj, type) and issubclass(obj, nnx.Module))


def wrap(layers: Sequence[Any], i: int, owner: dict, shared: list | None = None) -> NnxLayer:
    """Layer `i` of `layers`, an NNX module, split into an `NnxLayer`; its
    variables and submodules are recorded in `owner` (id -> (layer index,
    path)). With a `shared` list, a parameter an earlier layer holds too is
    appended to it as a pair of (layer, path) (tied weights, layers/ties.py).

    Raises:
      LayerError: naming the layers, when it is an NNX class rather than an
        instance, holds abstract parameters (built under `nnx.eval_shape`),
        or shares variables with an earlier layer (the same module twice,
        tied weights): a pipeline places each layer's parameters on one stage.
    """
    layer = layers[i]
    if isinstance(layer, nnx.Module) and id(layer) in owner:
        j = owner[id(layer)][0]
        raise LayerError(
            f"layers {j} and {i} ({type(layer).__name__}) are one module object; {SHARED}")
    if isinstance(layer, type):
        raise LayerError(f"layer {i} is the class {layer.__name__}, not a module; give an "
                         f"instance, e.g. {layer.__name__}(..., rngs=nnx.Rngs(0))")
    name = type(layer).__name__
    for path, node in nnx.iter_graph(layer):
        # Random streams may be shared: they are reseeded at every call, never trained.
        if not isinstance(node, (nnx.Variable, nnx.Module)) or isinstance(node, nnx.RngState):
            continue
        j, at = owner.setdefault(id(node), (i, path))
        if j != i and shared is not None:
            if isinstance(node, nnx.Param):
                shared.append(((j, tuple(map(str, at))), (i, tuple(map(str, path)))))
        elif j != i:
            what = ".".join(map(str, path)) or "the whole module"
            raise LayerError(
                f"layers {j} ({type(layers[j]).__name__}) and {i} ({name}) share {what} "
                f"({type(node).__name__}); {SHARED}")
    split = NnxLayer(layer)
    abstract = [f"{_path(p)}" for p, v in nnx.to_flat_state(split.values())
                if not isinstance(v.get_value(), (jax.Array, np.ndarray))]
    if abstract:
        raise LayerError(f"layer {i} ({name}) holds abstract parameters ({', '.join(abstract)}"
                         ": no values); build it with real values, e.g. "
                         f"{name}(..., rngs=nnx.Rngs(0)), not under nnx.eval_shape")
    return split


def write_into(values: Sequence[Any], into: Any) -> None:
    """`nnx.update` each NNX module of `into` (a list, `nnx.Sequential` or
    `nnx.List` of the layers a pipeline was given, or `pipe.layers`) with its entry of
    `values` (one per layer, as `pj.unstage` returns them).

    Raises:
      LayerError: when `into` has another number of layers, or an NNX
        module whose parameters differ in structure or shape from its values.
    """
    modules = items(into)
    if modules is None or len(modules) != len(values):
        got = "not a list" if modules is None else f"{len(modules)} layers"
        raise LayerError(f"unstage(..., into=...) takes the layer list the pipeline was given "
                         f"({len(values)} layers), got {got}")
    for i, (module, v) in enumerate(zip(modules, values)):
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
