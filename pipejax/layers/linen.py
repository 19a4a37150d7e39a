"""A Flax linen module as a layer: `module.init` / `module.apply`.

Linen modules describe layers without holding values: the pipeline
initializes each from its own key (`fold_in(key, i)`), with the same key
for the 'params' and 'dropout' streams, and feeds the 'dropout' stream when
training. `deterministic=` / `train=` are passed to modules whose `__call__`
takes them. A module held inside another layer's fields and used by a
second layer is shared (tied weights): `own_submodules` rejects it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from pipejax.errors import LayerError
from pipejax.layers.base import SHARED, Decoder, Layer, Variables


# Where a mesh is in context, Flax turns every partitioning annotation into a
# sharding constraint, in `apply` and in the shape check it runs on each
# init; a pipeline's mesh axes there are manual (or absent) but `tensor`,
# and the pipeline places the parameters itself (packing.py,
# compile/tensor.py): a layer runs with no mesh in context.
_NO_MESH = jax.sharding.AbstractMesh((), ())


def _call_kwargs(module: nn.Module, train: bool) -> dict:
    """`deterministic=` / `train=` for modules whose `__call__` takes them.

    A module that fixed `deterministic` at construction is left alone (Flax
    rejects the flag given twice).
    """
    params = inspect.signature(type(module).__call__).parameters
    kwargs = {}
    if "deterministic" in params and getattr(module, "deterministic", None) is None:
        kwargs["deterministic"] = not train
    if "train" in params and getattr(module, "train", None) is None:
        kwargs["train"] = train
    return kwargs


@dataclasses.dataclass(frozen=True, eq=False)
class LinenLayer:
    """One linen module of a layer list (module docstring)."""

    module: nn.Module

    source = property(lambda self: self.module, doc="The linen module.")
    name = property(lambda self: type(self.module).__name__, doc="The module's class.")
    dtype = property(lambda self: getattr(self.module, "dtype", None),
                     doc="The module's own Flax `dtype` (None: as its inputs).")
    detail = ""

    def init(self, key: jax.Array, x: Any) -> Variables:
        """Flax's `init` with `key` for the 'params' and 'dropout' streams."""
        variables = self.module.init({"params": key, "dropout": key}, x,
                                     **_call_kwargs(self.module, False))
        return dict(variables)

    def initial_values(self) -> None:
        """None: a linen module's parameters are made by `init`."""
        return None

    def apply(self, variables: Variables, x: Any, key: jax.Array | None = None,
              train: bool = True) -> Any:
        """Flax's `apply`; `key` feeds the 'dropout' stream when training."""
        rngs = {"dropout": key} if (train and key is not None) else None
        with jax.sharding.use_abstract_mesh(_NO_MESH):
            return self.module.apply(variables, x, rngs=rngs, **_call_kwargs(self.module, train))

    def kept_state(self, variables: Any, x: Any, key: Any) -> str | None:
        """The mutable collections besides 'params' that `init` made."""
        extra = sorted(set(variables) - {"params"})
        if not extra:
            return None
        return (f"keeps mutable collections {extra} (BatchNorm statistics?); pipelines train "
                "stateless layers only: use GroupNorm or LayerNorm instead")

    def without_values(self) -> LinenLayer:
        """Itself: it holds no parameters."""
        return self

    def same(self, other: Layer) -> bool:
        """The same module, or equal modules of one class (`nn.Dense(64) ==
        nn.Dense(64)`); fields that do not compare (arrays): not provably equal."""
        if not isinstance(other, LinenLayer):
            return False
        a, b = self.module, other.module
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - fields that do not compare: not provably equal
            return False

    def decoder(self) -> Decoder | None:
        """Flax's decode mode, for a module with a `decode` field (Flax's
        convention: `nn.MultiHeadDotProductAttention(decode=True)` keeps its
        keys and values in the 'cache' collection): its clone with
        `decode=True` makes the collection on a whole window, then computes
        one position at a time with it mutable. None without the field."""
        if "decode" not in {f.name for f in dataclasses.fields(self.module)}:
            return None
        module = self.module.clone(decode=True)
        kwargs = _call_kwargs(module, False)

        def run(variables: Variables, x: Any) -> tuple[Any, Any]:
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                y, mutated = module.apply(variables, x, mutable=["cache"], **kwargs)
            return y, dict(mutated).get("cache", {})

        def init(variables: Variables, x: Any) -> Any:
            made = jax.eval_shape(lambda v, x: run(v, x)[1], variables, x)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), made)

        def step(variables: Variables, cache: Any, x: Any) -> tuple[Any, Any]:
            return run({**variables, "cache": cache}, x)

        return Decoder(init, step)


def _walk(value: Any, path: str) -> Iterator[tuple[str, nn.Module]]:
    """The linen modules in `value` and its fields, at any depth, by path."""
    if isinstance(value, nn.Module):
        yield path, value
        for field in dataclasses.fields(value):
            if field.name not in ("parent", "name"):
                yield from _walk(getattr(value, field.name, None), f"{path}.{field.name}")
    elif isinstance(value, (list, tuple)):
        for j, item in enumerate(value):
            yield from _walk(item, f"{path}[{j}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}[{key!r}]")


def own_submodules(layers: Sequence[Any], i: int, owner: dict,
                   shared: list | None = None) -> None:
    """Record the linen modules held in layer `i`'s fields (at any depth) as
    layer i's; one already held by, or listed as, another layer is shared.

    Linen trains such a module's parameters once (tied input and output
    embeddings). With a `shared` list, each is appended to it as a pair of
    (layer, path of its parameters) (layers/ties.py); without, it is an
    error. A linen module listed twice at the top is two layers.

    Raises:
      LayerError: naming both layers and the shared module.
    """
    top = {}
    for j, layer in enumerate(layers):
        top.setdefault(id(layer), j)
    if top[id(layers[i])] != i:
        return  # a layer listed again: its copy was walked
    for path, module in list(_walk(layers[i], ""))[1:]:
        j, at = owner.setdefault(id(module), (i, path))
        j, at = (top[id(module)], "") if j == i and id(module) in top else (j, at)
        if j != i and shared is not None:
            shared.append(((j, _params_path(at, j, layers)), (i, _params_path(path, i, layers))))
        elif j != i:
            raise LayerError(
                f"layers {j} ({type(layers[j]).__name__}) and {i} ({type(layers[i]).__name__}) "
                f"share the module {type(module).__name__} (layer {i}'s field {path[1:]}); "
                f"{SHARED}")


def _params_path(path: str, i: int, layers: Sequence[Any]) -> tuple[str, ...]:
    """Where a module held at field path `path` of layer `i` keeps its
    parameters in the layer's variables: Flax names a module held in a field
    by the field ('.embed' -> params.embed; '' is the layer itself)."""
    if "[" in path:
        raise LayerError(f"layer {i} ({type(layers[i]).__name__}) holds a shared module in "
                         f"{path[1:]}, inside a list or dict; tie a module held in a field")
    return ("params", *[p for p in path.split(".") if p])
