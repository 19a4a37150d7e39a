"""The outer part of an update: the pieces that run around the per-stage chains.

An update is two parts, as optax chains transforms (collectives
never sit in a branch of the stage switch):

- the outer part, over the packed buffers of a device, outside the switch,
  where collectives may run: the data rule's `before` half (SSGD's mean over
  the replicas), the non-finite mask, the clip by the global norm over all
  stages, and after the inner part the rule's `after` half (gossip, elastic
  averaging);
- the inner part, each stage's optax chain on its own trees, inside the
  switch (pipejax/compile/optimizer.py).

The rules are element-wise, so on packed buffers (padding holds zeros) they
equal the rules on the stage trees; the mask and the clip reduce over the
buffers and psum over mesh axes. Each piece is a function of packed buffers,
testable alone inside a `shard_map`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pipejax.packing import Buffers
from jax.sharding import Mesh

from pipejax.errors import ArgumentTypeError, ConfigError
from pipejax.mesh import STAGE, FSDP, TENSOR, data_axes, model_axes
from pipejax.transforms.data_parallel import DataRule, consensus_distance, ssgd


def all_finite(grads: Buffers, scope: tuple[str, ...] = ()) -> jax.Array:
    """Whether every gradient element is finite, on every device of mesh axes `scope`."""
    bad = sum(jnp.sum(~jnp.isfinite(d)) for d in grads).astype(jnp.int32)
    return (lax.psum(bad, scope) if scope else bad) == 0


def clip_by_global_norm(grads: Buffers, max_norm: float, ok: jax.Array | None = None,
                        model: tuple[str, ...] = (STAGE,), counted: Buffers | None = None
                        ) -> Buffers:
    """`optax.clip_by_global_norm` over the gradients of ALL stages: the
    squared norm is summed over the mesh axes `model` that hold the model's
    parts (the stages; with FSDP their pieces; padding holds zeros), so the
    clip means what it means for the unpipelined model; over `counted`
    where given (tied weights counted once, compile/ties.py). A stage whose
    gradient the guard drops (`ok` false) adds nothing to the norm."""
    square = sum(jnp.sum(jnp.square(d.astype(jnp.float32)))
                 for d in (grads if counted is None else counted))
    if ok is not None:
        square = jnp.where(ok, square, 0.0)
    norm = jnp.sqrt(lax.psum(square, model))
    trigger = norm < max_norm
    return tuple(lax.select(trigger, d, (d / norm.astype(d.dtype)) * max_norm) for d in grads)


@dataclasses.dataclass(frozen=True)
class Outer:
    """The outer pieces of a trainer's update: the data rule between its
    replicas, the global-norm clip, and whether to skip (and count) an
    update whose gradient is not finite."""

    rule: DataRule | None = None
    clip_norm: float | None = None  # clip by the global norm over all stages
    skip_nonfinite: bool = False
    model: tuple[str, ...] = (STAGE,)  # the mesh axes holding the model's parts (`model_axes`)

    def __post_init__(self):
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"clip_norm={self.clip_norm}; the largest global gradient norm must "
                              "be a positive number (or None for no clipping)")

    @classmethod
    def of(cls, rule: DataRule | None, mesh: Mesh, clip_norm: float | None = None,
           skip_nonfinite: bool = False) -> "Outer":
        """The outer pieces of a trainer on `mesh`, its rule checked against
        the mesh (default SSGD over every data axis; None without data axes)."""
        return cls(_check_rule(rule, mesh), clip_norm, skip_nonfinite, model_axes(mesh))

    @property
    def collective(self) -> bool:
        """Whether an update runs collectives around the chain (a rule, the clip)."""
        return self.rule is not None or self.clip_norm is not None

    def init(self, p: Buffers) -> tuple:
        """Inside shard_map: the rule's (before, after) states; () without a rule."""
        return () if self.rule is None else (self.rule.before.init(p), self.rule.after.init(p))

    def before(self, grads: Buffers, rule_state: tuple, p: Buffers) -> tuple[Buffers, tuple]:
        """The rule's `before` half (SSGD: the gradient mean over the replicas)."""
        return self._half(0, grads, rule_state, p)

    def after(self, updates: Buffers, rule_state: tuple, p: Buffers) -> tuple[Buffers, tuple]:
        """The rule's `after` half, on the chain's updates (gossip, elastic)."""
        return self._half(1, updates, rule_state, p)

    def _half(self, i: int, tree: Buffers, rule_state: tuple, p: Buffers) -> tuple[Buffers, tuple]:
        if self.rule is None:
            return tree, rule_state
        states = list(rule_state)
        tree, states[i] = (self.rule.before, self.rule.after)[i].update(tree, states[i], p)
        return tree, tuple(states)

    def clip(self, grads: Buffers, ok: jax.Array | None, counted: Buffers | None = None
             ) -> Buffers:
        """The clip by the global norm (of `counted` where given)."""
        if self.clip_norm is None:
            return grads
        return clip_by_global_norm(grads, self.clip_norm, ok, self.model, counted)

    def consensus(self, p: Buffers) -> jax.Array | None:
        """Inside shard_map: the spread of the replicas' weights (all stages),
        when the rule lets them differ; else None."""
        if self.rule is None or not self.rule.decentralized:
            return None
        return consensus_distance(p, self.rule.axes, over=self.model)


def _check_rule(rule: DataRule | None, mesh: Mesh) -> DataRule | None:
    """The rule between the replicas of a pipeline on `mesh`: `rule` checked against the
    mesh, SSGD over every data axis by default, None on a mesh without data axes."""
    axes, names = data_axes(mesh), tuple(mesh.axis_names)
    if rule is None:
        return ssgd(axes) if axes else None
    if not isinstance(rule, DataRule):
        raise ArgumentTypeError(f"rule must be a pj.transforms.DataRule (ssgd, adpsgd, hadpsgd, "
                                f"elastic), not {type(rule).__name__}")
    for a in rule.axes:
        if a in (STAGE, FSDP, TENSOR):
            raise ConfigError(f"rule {rule.name!r} names the mesh axis {a!r}, whose devices hold "
                              f"parts of one model; a data rule combines replicas over the data "
                              f"axes {axes}")
        if a not in names:
            raise ConfigError(f"rule {rule.name!r} names mesh axis {a!r}, but the mesh has axes "
                              f"{names}; build the mesh with that axis (pj.make_mesh(stages, "
                              "data, nodes)) or name one of its data axes")
    unused = [a for a in axes if a not in rule.axes and mesh.shape[a] > 1]
    if unused:
        raise ConfigError(f"rule {rule.name!r} communicates over {rule.axes} but the mesh's data "
                          f"axis {unused[0]!r} ({mesh.shape[unused[0]]} replicas) is in none "
                          "of them: its replicas would train apart; use a rule over every data "
                          "axis (hadpsgd for ('node', 'local'))")
    return rule
