"""A checkpoint on disk: the names of its entries, reading one back, and
checking it against a layer list (checkpoint.py writes and re-packs them).

Entries are flat: `layer{i}.` + a variable's dotted path (`layer3.params.kernel`),
each with a leading replica axis; `meta` (JSON) holds the format, the step and
each layer's name and variable shapes.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from pipejax.errors import CheckpointError

FORMAT = 1


def name(path: tuple) -> str:
    """A key path as a short dotted name ('params.kernel')."""
    parts = [str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path]
    return ".".join(parts)


def flat(prefix: str, tree: Any) -> dict[str, Any]:
    return {f"{prefix}{name(path)}": leaf for path, leaf in jax.tree.flatten_with_path(tree)[0]}


def describe(tree: Any) -> str:
    return ", ".join(f"{name(p)} {np.dtype(x.dtype)}{list(x.shape)}"
                     for p, x in jax.tree.flatten_with_path(tree)[0]) or "no variables"


def manager(path: str | os.PathLike, keep: int | None = None) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(os.fspath(path)),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def latest(path: str | os.PathLike) -> int | None:
    """The step of the latest complete checkpoint under `path`, or None."""
    if not os.path.isdir(path):
        return None
    mgr = manager(path)
    step = mgr.latest_step()
    mgr.close()
    return step


def check(meta: dict, specs: Sequence[Any]) -> None:
    """Raise unless the checkpoint's layers are those of `specs` (a traced
    layer list), naming the first that differs."""
    saved = meta["layers"]
    for i, ((name, shapes), spec) in enumerate(zip(saved, specs)):
        mine = describe(spec.variables)
        if name != spec.name or shapes != mine:
            raise CheckpointError(
                f"layer {i} differs: the checkpoint has {name} with {shapes}, this "
                f"pipeline has {spec.name} with {mine}; restore into a pipeline of the same "
                "layer list")
    if len(saved) != len(specs):
        raise CheckpointError(f"the checkpoint holds {len(saved)} layers, this pipeline "
                              f"{len(specs)}; restore into a pipeline of the same layer list")


def read(path: str | os.PathLike, step: int | None) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays by name) of checkpoint `step` (None: the latest) under `path`."""
    mgr = manager(path)
    steps = mgr.all_steps()
    if not steps or (step is not None and step not in steps):
        mgr.close()
        raise CheckpointError(f"no checkpoint{'' if step is None else f' of step {step}'} in "
                              f"{os.fspath(path)} (steps there: {sorted(steps)})")
    step = max(steps) if step is None else step
    meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("format") != FORMAT:
        mgr.close()
        raise CheckpointError(f"checkpoint format {meta.get('format')} in {os.fspath(path)}; this "
                              f"pipejax reads format {FORMAT}")
    tree = mgr.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore()))
    mgr.close()
    arrays = {k: np.asarray(v) for k, v in tree["arrays"].items()}
    for key in list(arrays):  # a tied copy, saved once, read as its tie's first holder
        prefix, rest = parameter(key)
        for copy, first in meta.get("copies", {}).items():
            if rest == first:
                arrays[prefix + copy] = arrays[key]
    return meta, arrays


def parameter(key: str) -> tuple[str, str]:
    """An entry name as (its 'optJ.' prefix or '', the layer's parameter
    it is or belongs to: 'layerI.path')."""
    if key.startswith("opt"):
        prefix, rest = key.split(".", 1)
        return prefix + ".", rest
    return "", key


def entries(tree: dict, prefix: str, template: Any,
            pick: Callable[[np.ndarray], np.ndarray]) -> Any:
    """`template` (a tree of ShapeDtypeStructs) filled from the checkpoint's
    entries `prefix` + path, each through `pick` (one replica's slice)."""
    def get(path, want):
        key = f"{prefix}{name(path)}"
        if key not in tree or pick(tree[key]).shape != tuple(want.shape):
            got = "nothing" if key not in tree else f"shape {list(pick(tree[key]).shape)}"
            raise CheckpointError(f"checkpoint entry {key}: expected {np.dtype(want.dtype)}"
                                  f"{list(want.shape)}, found {got}")
        return pick(tree[key]).astype(want.dtype)
    return jax.tree_util.tree_map_with_path(get, template)


def kinds(opt_state: Any) -> list[str]:
    """The optax state classes in `opt_state`, in order (`ScaleByAdamState`,
    `EmptyState`, ...): what names the optimizer a checkpoint was saved by."""
    out: list[str] = []

    def visit(node: Any) -> None:
        if hasattr(node, "_fields"):
            out.append(type(node).__name__)
        children = node.values() if isinstance(node, dict) else (
            node if isinstance(node, (tuple, list)) else ())
        for child in children:
            visit(child)

    visit(opt_state)
    return out


def check_optimizer(meta: dict, opt_state: Any) -> None:
    """Raise unless the checkpoint was saved by an optimizer whose state has
    the classes of `opt_state` (a stage's, abstract), naming both."""
    saved, mine = meta.get("optimizer"), kinds(opt_state)
    if saved is not None and saved != mine:
        raise CheckpointError(
            f"the checkpoint was saved by an optimizer whose state is ({', '.join(saved)}), "
            f"this trainer's is ({', '.join(mine)}): restore with the optimizer it was saved "
            "with, or read its parameters alone with pj.checkpoint.load_variables")
