"""One pipeline at several micro-batch shapes, as `jax.jit` compiles a function once per shape.

A pipeline is traced with one example micro-batch. A batch whose axes other
than the batch axis differ from the example's (a language model's sequence
length) is traced again at its own shape with the pipeline's partition,
placement, schedule and mesh, so its parameters and optimizer state pack
exactly as the pipeline's and one state trains at every shape: a `Build` per
shape, and a program per build, compiled on its first call (`trainer.step`,
`pipe.value_and_grad`), at most `max_shapes` shapes (`pj.pipeline`). A layer
whose parameters depend on the shape (a Dense over a flattened sequence, a
position table shorter than the sequence) is named.

The rings a synchronous trainer carries from step to step
(`TrainState.scratch`) are shaped for the example: a step at another shape
passes them through untouched and fills rings of its own, as
`pipe.value_and_grad` does. An asynchronous schedule keeps micro-batches in
flight from one step to the next in rings of the example's shape, so it runs
that shape only: pad to it (`pj.data.pad_to_lengths`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.compile import ids
from pipejax.compile.build import Build
from pipejax.errors import BatchError, ConfigError

Key = tuple  # per leaf of (inputs, targets): its dtype and its axes after the batch axis


def _leaves(batch: Any) -> list | None:
    """The leaves of a batch `(x, y)`, None when it is not a pair."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return None
    return jax.tree.leaves(tuple(batch))


def _key(leaves: list) -> Key:
    return tuple((str(jnp.result_type(a)), tuple(np.shape(a)[1:])) for a in leaves)


def describe(key: Key) -> str:
    """A shape key as the micro-batch axes after the batch axis, e.g. `int32[·, 32]`."""
    return ", ".join(f"{d}[·{''.join(f', {n}' for n in shape)}]" for d, shape in key)


class Shapes:
    """The builds of one pipeline, one per micro-batch shape it has met.

    `of(batch)` is the build for a batch: the pipeline's own when the batch
    has the example's shapes, or is not a batch of this pipeline at all (a
    wrong structure, size or dtype: the pipeline's own check then names
    it); else the build traced at the batch's shapes, made once."""

    def __init__(self, base: Build, rebuild: Callable[[Any, Any], Build],
                 max_shapes: int | None = None, ranges: ids.Ranges | None = None):
        if max_shapes is not None and not (isinstance(max_shapes, int) and max_shapes >= 1):
            raise ConfigError(f"max_shapes={max_shapes!r}; use an int >= 1 (the micro-batch "
                              "shapes a pipeline compiles for) or None for no bound")
        self.base, self.max_shapes, self._rebuild = base, max_shapes, rebuild
        self.ranges = ranges  # the ids checked before every step; None: unchecked
        whole = jax.tree.leaves((base.example, base.targets))
        self._dtypes = [leaf.dtype for leaf in whole]
        self._builds: dict[Key, Build] = {_key(whole): base}
        self._rows = [base.R * base.M * base.F * leaf.shape[0] for leaf in whole]
        self._structure = jax.tree.structure((base.example, base.targets))

    @property
    def keys(self) -> list[Key]:
        """The shapes built so far, the pipeline's own first."""
        return list(self._builds)

    def cast(self, batch: Any) -> Any:
        """`batch` with each integer leaf of another integer dtype than the
        pipeline's in the pipeline's (tokens as uint8 or uint16, as corpora
        are stored, or NumPy's int64: as `jax.jit` takes int64 as int32); a
        batch of another structure as it is (the pipeline's check names it)."""
        leaves = _leaves(batch)
        if leaves is None or jax.tree.structure(tuple(batch)) != self._structure:
            return batch
        integer = lambda d: jnp.issubdtype(d, jnp.integer)
        return tuple(jax.tree.unflatten(self._structure, [
            a.astype(d) if integer(jnp.result_type(a)) and integer(d)
            and jnp.result_type(a) != d else a for a, d in zip(leaves, self._dtypes)]))

    def of(self, batch: Any, where: str) -> Build:
        """The build that runs `batch` (see the class); with `ranges`
        (`pj.pipeline(checks=True)`), its ids checked first (compile/ids.py)."""
        if self.ranges is not None:
            ids.check(batch, self.ranges, where)
        leaves = _leaves(batch)
        if (leaves is None or jax.tree.structure(tuple(batch)) != self._structure
                or any(np.ndim(a) == 0 or np.shape(a)[0] != n
                       for a, n in zip(leaves, self._rows))):
            return self.base
        key = _key(leaves)
        if key in self._builds:
            return self._builds[key]
        own = next(iter(self._builds))
        if [d for d, _ in key] != [d for d, _ in own] or [len(s) for _, s in key] != [
                len(s) for _, s in own]:
            return self.base  # another dtype or rank: the pipeline's check says what to give
        if self.base.schedule.asynchronous:
            raise BatchError(
                f"{where}: micro-batches {describe(key)}, but {self.base.schedule.name!r} keeps "
                f"micro-batches of {describe(own)} in flight from one step to the next, so it "
                "runs that shape only; pad the batch to it (pj.data.pad_to_lengths) or use a "
                "synchronous schedule, which compiles a program per shape")
        if self.max_shapes is not None and len(self._builds) >= self.max_shapes:
            raise BatchError(
                f"{where}: micro-batches {describe(key)} would be shape {len(self._builds) + 1}, "
                f"past max_shapes={self.max_shapes} (built: "
                f"{'; '.join(describe(k) for k in self._builds)}); pad batches to one of those "
                "(pj.data.pad_to_lengths), or raise max_shapes")
        x, y = jax.tree.unflatten(self._structure, [
            jax.ShapeDtypeStruct((e.shape[0], *shape), dtype)
            for e, (dtype, shape) in zip(jax.tree.leaves((self.base.example, self.base.targets)),
                                         key)])
        self._builds[key] = built = self._rebuild(x, y)
        return built


class PerShape:
    """A program at every shape of a pipeline: called, lowered or traced
    with arguments whose `batch`-th is a batch, it runs (lowers, traces) the
    program made by `make` for that batch's build, once per build; `check`
    sees the arguments first. Other attributes are the pipeline's own
    shape's program's."""

    def __init__(self, shapes: Shapes, make: Callable[[Build], Any], where: str,
                 batch: int | None = 1, check: Callable[[tuple], None] | None = None):
        self._shapes, self._make, self._where, self._batch = shapes, make, where, batch
        self._check = check
        self._programs: dict[Build, Any] = {shapes.base: make(shapes.base)}

    def program(self, args: tuple) -> Any:
        """The program for `args` (their batch cast, `Shapes.cast`), made on first use."""
        if self._check is not None:
            self._check(args)
        b = (self._shapes.base if not self._batched(args)
             else self._shapes.of(args[self._batch], self._where))
        if b not in self._programs:
            self._programs[b] = self._make(b)
        return self._programs[b]

    def _batched(self, args: tuple) -> bool:
        return self._batch is not None and len(args) > self._batch

    def _cast(self, args: tuple) -> tuple:
        """`args` with their batch in the pipeline's integer dtypes (`Shapes.cast`)."""
        if not self._batched(args):
            return args
        i = self._batch
        return (*args[:i], self._shapes.cast(args[i]), *args[i + 1:])

    def __call__(self, *args):
        args = self._cast(args)
        return self.program(args)(*args)

    def lower(self, *args):
        args = self._cast(args)
        return self.program(args).lower(*args)

    def trace(self, *args):
        args = self._cast(args)
        return self.program(args).trace(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._programs[self._shapes.base], name)
