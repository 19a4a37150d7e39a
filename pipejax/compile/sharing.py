"""Stages of one structure share one branch of the stage switch.

Each stage's code is a branch of a `lax.switch` on the stage index, and XLA
compiles every branch: a model of identical blocks split into K stages held
K copies of one block's code, so compile time grew with depth (6.7 s for
257 layers at K = 32). Stages whose layers are equal with equal
shapes form one group; the switch indexes a static table from stage to
group, so the program holds one branch per distinct stage structure. What
differs between a group's stages (the global index of its first layer, for
the dropout keys) the branch reads from the stage index. MaxText instead
vmaps one stage over identical ones, which needs every stage alike; the
table keeps heterogeneous stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import lax

from pipejax.compile.rendezvous import branch_of, varying
from pipejax.compile.spmd import run_if, stage_index


@dataclasses.dataclass(frozen=True)
class StageGroups:
    """Which branch every stage runs: `of[k]` is stage k's group, `first[g]`
    the first stage of group g (whose static layout the branch is built for)."""

    of: tuple[int, ...]
    first: tuple[int, ...]

    @classmethod
    def by(cls, keys: Sequence[Any], same: Callable[[Any, Any], bool],
           share: bool = True) -> "StageGroups":
        """Group stages whose `keys` are `same` (an equivalence relation);
        every stage its own group unless `share` (what `pipejax bench`
        compares the shared program against)."""
        if not share:
            return cls(tuple(range(len(keys))), tuple(range(len(keys))))
        of: list[int] = []
        first: list[int] = []
        for k, key in enumerate(keys):
            g = next((g for g, j in enumerate(first) if same(keys[j], key)), None)
            if g is None:
                g = len(first)
                first.append(k)
            of.append(g)
        return cls(tuple(of), tuple(first))

    def __len__(self) -> int:
        return len(self.first)

    def branches(self, build: Callable[[int], Callable]) -> list[Callable]:
        """One branch per group, built for the group's first stage."""
        return [build(k) for k in self.first]

    def switch(self, branches: Sequence[Callable], *operands: Any) -> Any:
        """Inside shard_map: this device's stage's branch applied to `operands`."""
        if len(branches) == 1:
            return branches[0](*operands)
        with varying():
            return lax.switch(self.index(), self._named(branches), *operands)

    def switch_at(self, j: Any, branches: Sequence[Callable], *operands: Any) -> Any:
        """Inside shard_map: the branch of (virtual) stage `j`'s group applied to `operands`."""
        if len(branches) == 1:
            return branches[0](*operands)
        with varying():
            return lax.switch(jnp.asarray(self.of, jnp.int32)[j], self._named(branches), *operands)

    def run(self, branches: Sequence[Callable], operands: Any, carry: Any,
            at: Any = None) -> Any:
        """Inside shard_map: `branches[g](operands, carry)` for this device's
        group g (or, given `at`, virtual stage `at`'s group), as one loop of
        0 or 1 trips per group. Unlike `switch` (a conditional, whose results
        XLA writes to buffers of their own and then copies into a donated or
        loop-carried state) the loops update `carry` in place."""
        if len(branches) == 1:
            return branches[0](operands, carry)
        index = self.index() if at is None else jnp.asarray(self.of, jnp.int32)[at]
        with varying():
            for g, branch in enumerate(self._named(branches)):
                carry = run_if(index == g, branch, operands, carry)
        return carry

    def _named(self, branches: Sequence[Callable]) -> list[Callable]:
        """Each group's branch traced under the names of the stages that run
        it, which a collective there carries into the compiled HLO (rendezvous.py)."""
        return [branch_of([k for k, o in enumerate(self.of) if o == g], b)
                for g, b in enumerate(branches)]

    def index(self) -> Any:
        """Inside shard_map: this device's group."""
        if self.of == tuple(range(len(self.of))):
            return stage_index()
        return jnp.asarray(self.of, jnp.int32)[stage_index()]
