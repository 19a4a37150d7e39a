"""Micro-batches: a batch `[R·M·mb, ...]` checked and split into `[R, M, mb, ...]`.

GPipe (§2.2) splits a mini-batch into M equal micro-batches; on a mesh with
data axes the batch first splits into R equal replica parts (replica-major,
replica r takes rows r·M·mb to (r+1)·M·mb); on a stage sharded over F
devices each micro-batch splits into F equal parts, one a device, and the
pipeline was traced with one part. The pipeline was
traced with ONE example micro-batch of inputs and one of targets, so a batch
must be M of them, stacked; the check runs at trace time (shapes are static),
so a wrong batch is a clear error before anything is compiled.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pipejax.errors import BatchError


def _shape(a: Any) -> list[int]:
    return list(jnp.shape(a))


def _check(name: str, batch: Any, example: Any, M: int, R: int) -> None:
    parts = f"{R} data replicas x microbatches={M}" if R > 1 else f"microbatches={M}"
    for a, e in zip(jax.tree.leaves(batch), jax.tree.leaves(example)):
        n = jnp.shape(a)[0] if jnp.ndim(a) else 0
        if n % (R * M):
            raise BatchError(f"{name} of {n} examples do not split into {parts} "
                             f"({n} % {R * M} = {n % (R * M)}); use a batch size divisible by "
                             f"{R * M}")
        if [n // (R * M), *_shape(a)[1:]] != _shape(e) or jnp.result_type(a) != jnp.result_type(e):
            raise BatchError(
                f"{name} {jnp.result_type(a)}{_shape(a)} split into {parts} micro-batches of "
                f"{[n // (R * M), *_shape(a)[1:]]}, but the pipeline was built for micro-batches "
                f"{jnp.result_type(e)}{_shape(e)}; give {name} of shape "
                f"{[R * M * _shape(e)[0], *_shape(e)[1:]]} and dtype {jnp.result_type(e)}")


def whole(part: Any, F: int) -> Any:
    """The ShapeDtypeStructs of a micro-batch of F parts shaped like `part`."""
    return jax.tree.map(lambda e: jax.ShapeDtypeStruct((e.shape[0] * F, *e.shape[1:]), e.dtype),
                        part)


def divide(batch: Any, M: int, example: Any, targets: Any, R: int = 1,
          F: int = 1) -> tuple[Any, Any]:
    """`(x, y)` with leading axis R·M·mb -> `(x, y)` with leading axes [R,
    M, mb], for a pipeline traced with micro-batch parts `example` and
    `targets` of mb / F examples each."""
    example, targets = whole(example, F), whole(targets, F)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise BatchError("a batch is a pair (x, y) of inputs and targets")
    x, y = batch
    if jax.tree.structure(x) != jax.tree.structure(example):
        raise BatchError(f"inputs {jax.tree.structure(x)} do not match the structure of the "
                         f"example {jax.tree.structure(example)}")
    if jax.tree.structure(y) != jax.tree.structure(targets):
        raise BatchError(f"targets {jax.tree.structure(y)} do not match the structure of the "
                         f"pipeline's targets {jax.tree.structure(targets)}")
    _check("inputs", x, example, M, R)
    _check("targets", y, targets, M, R)
    n_x, n_y = jnp.shape(jax.tree.leaves(x)[0])[0], jnp.shape(jax.tree.leaves(y)[0])[0]
    if n_x != n_y:
        raise BatchError(f"targets hold {n_y} examples but inputs hold {n_x}; give one target "
                         "per example")
    cut = lambda a: a.reshape(R, M, a.shape[0] // (R * M), *a.shape[1:])
    return jax.tree.map(cut, x), jax.tree.map(cut, y)
