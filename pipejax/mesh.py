"""The device mesh a pipeline runs on: axis `stage`, one index per stage,
optional data axes, one pipeline replica per index of them, an optional
`fsdp` axis, the devices one stage is sharded over, and an optional
`tensor` axis, the devices each annotated layer is split over.

A mesh ("stage",) runs one pipeline; ("data", "stage") runs one replica per
data index; ("node", "local", "stage") groups the replicas for hierarchical
rules (H-ADPSGD); ("stage", "fsdp") splits each stage's parameters,
gradients and optimizer state over F devices, and each micro-batch with
them (ZeRO-3; compile/fsdp.py); ("stage", "tensor") splits each parameter
whose Flax annotation names "tensor" over T devices, which run every
micro-batch together (Megatron's tensor parallelism, compile/tensor.py).
`AXES` says what each axis name means; a mesh with any other name is an
error (pipejax would otherwise have to guess what it is for). The replicas
are numbered row-major over the data axes, in mesh order.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from pipejax.errors import ConfigError, DeviceError

# The axis names a pipeline's mesh may have.
STAGE, DATA, NODE, LOCAL, FSDP, TENSOR = "stage", "data", "node", "local", "fsdp", "tensor"
# What each means.
AXES = {STAGE: "the pipeline's stages",
        DATA: "pipeline replicas (data parallelism)",
        NODE: "groups of replicas (hierarchical rules: H-ADPSGD, elastic over nodes)",
        LOCAL: "the replicas within a node",
        FSDP: "the devices of one stage: its parameters, gradients and optimizer state split "
              "over them, each micro-batch too (ZeRO-3)",
        TENSOR: "the devices each parameter annotated with this name is split over (tensor "
                "parallelism: every micro-batch runs on all of them)"}
DATA_AXES = (DATA, NODE, LOCAL)  # the axes whose indices are replicas


def simulate_devices(n: int) -> None:
    """Make the CPU backend expose `n` simulated devices.

    Must run before JAX initializes its backends (before the first array is
    made); the CLI calls it for you. It never lowers a count already asked for
    (by XLA_FLAGS or an earlier call): JAX's setting would override the flag.
    """
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                     os.environ.get("XLA_FLAGS", ""))
    asked = max(int(flag.group(1)) if flag else 1, jax.config.jax_num_cpu_devices or 1)
    if asked >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except (RuntimeError, AttributeError) as err:
        if len(jax.devices()) >= n:
            return
        raise DeviceError(
            f"cannot simulate {n} CPU devices: JAX is already initialized with "
            f"{len(jax.devices())}; call pj.simulate_devices({n}) before any JAX computation, or "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python"
        ) from err
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={n}")


def stage_mesh(stages: int, mesh: Mesh | None = None) -> Mesh:
    """The given mesh, checked, or a 1-D mesh over the first `stages` devices."""
    if mesh is not None:
        if STAGE not in mesh.axis_names:
            raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} have no {STAGE!r} axis; "
                              f"name the pipeline axis {STAGE!r}, e.g. "
                              f"pj.make_mesh({stages}), or jax.sharding.Mesh(devices, ('data', '{STAGE}'))")
        unknown = [a for a in mesh.axis_names if a not in AXES]
        if unknown:
            known = "; ".join(f"{name!r}: {meaning}" for name, meaning in AXES.items())
            raise ConfigError(f"mesh axes {tuple(mesh.axis_names)}: pipejax does not know "
                              f"{', '.join(map(repr, unknown))}; its axes are {known}")
        if mesh.shape[STAGE] != stages:
            raise ConfigError(f"mesh axis {STAGE!r} has {mesh.shape[STAGE]} devices but "
                              f"stages={stages}; they must be equal")
        # shard_map places the pipeline's buffers itself: Auto axes (jax.make_mesh
        # makes Explicit ones, which would ask every input to arrive pre-sharded).
        return Mesh(mesh.devices, mesh.axis_names)
    return make_mesh(stages)


def make_mesh(stages: int, data: int = 1, nodes: int = 1,
              devices: Sequence[jax.Device] | None = None, *, fsdp: int = 1,
              tensor: int = 1) -> Mesh:
    """A mesh of data × stages × fsdp × tensor devices (default:
    `jax.devices()`, those of every process): axes ("stage",) for data = 1,
    ("data", "stage"), or ("node", "local", "stage") with `nodes` groups of
    data / nodes replicas (hierarchical rules), then ("fsdp",) when fsdp > 1:
    each stage sharded over that many devices, then ("tensor",) when
    tensor > 1: each annotated parameter split over that many. The axes
    vary slowest to fastest in that order: a layer's tensor devices are
    neighbours (they reduce activations in every layer, as in MaxText and
    Megatron), then a stage's fsdp devices (they gather its weights at every
    tick that uses them), then a replica's stages."""
    for name, n in (("stages", stages), ("data", data), ("nodes", nodes), ("fsdp", fsdp),
                    ("tensor", tensor)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ConfigError(f"{name}={n!r}; use a positive integer")
    if data % nodes:
        raise ConfigError(f"data={data} replicas do not split into nodes={nodes} equal groups; "
                          f"use a multiple of {nodes}")
    devices, need = list(devices or jax.devices()), data * stages * fsdp * tensor
    if len(devices) < need:
        where = (f"{jax.process_count()} processes with {jax.local_device_count()} each"
                 if jax.process_count() > 1 else devices[0].platform)
        parts = [f"{n} {name}" for n, name in ((data, "replicas"), (stages, "stages"),
                                               (fsdp, "fsdp"), (tensor, "tensor"))
                 if n > 1 or name == "stages"]
        what = (" x ".join(parts) + " need") if len(parts) > 1 else f"stages={stages} needs"
        raise DeviceError(
            f"{what} {need} devices but JAX sees {len(devices)} ({where}); on CPU simulate them with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before importing jax "
            f"(or pj.simulate_devices({need}) before any JAX computation), or use fewer stages "
            "or replicas")
    names = (NODE, LOCAL) if nodes > 1 else (DATA,) if data > 1 else ()
    sizes = (nodes, data // nodes) if nodes > 1 else (data,) if data > 1 else ()
    names, sizes = (*names, STAGE), (*sizes, stages)
    for name, n in ((FSDP, fsdp), (TENSOR, tensor)):
        if n > 1:
            names, sizes = (*names, name), (*sizes, n)
    return Mesh(np.array(devices[:need]).reshape(sizes), names)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data axes (`DATA_AXES`), in mesh order."""
    return tuple(a for a in mesh.axis_names if a in DATA_AXES)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes a batch is split over: the data axes, then `fsdp` when a
    stage spans several devices (each runs its part of every micro-batch)."""
    return data_axes(mesh) + ((FSDP,) if fsdp_degree(mesh) > 1 else ())


def model_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes whose devices hold different parts of one model: `stage`,
    and `fsdp` when a stage spans several devices."""
    return (STAGE, FSDP) if fsdp_degree(mesh) > 1 else (STAGE,)


def fsdp_degree(mesh: Mesh) -> int:
    """F, the devices each stage is sharded over (1 without an `fsdp` axis)."""
    return int(mesh.shape.get(FSDP, 1))


def tensor_degree(mesh: Mesh) -> int:
    """T, the devices each annotated parameter is split over (1 without a `tensor` axis)."""
    return int(mesh.shape.get(TENSOR, 1))


def constrain(x: Any, axis: int | None) -> Any:
    """`x` split over `tensor` along `axis` (None: whole on every tensor
    device) where a program partitions that axis itself (inside the
    pipeline's `shard_map`, where it is the one axis left to XLA); `x`
    unchanged elsewhere (host arrays, no such axis). Pinned at every unpack
    and pack of a parameter (packing.py): propagation alone may choose to
    replicate a loop's carry, or to split a leaf no annotation splits."""
    if not isinstance(x, jax.core.Tracer):
        return x
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get(TENSOR, 1) == 1 or TENSOR not in mesh.auto_axes:
        return x
    spec = [None] * x.ndim
    if axis is not None:
        spec[axis] = TENSOR
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def manual_axes(mesh: Mesh) -> frozenset[str] | None:
    """The axes the pipeline's programs place by hand (`shard_map`): every
    one but `tensor`, which XLA partitions from the annotations (None:
    all of them, a mesh without tensor parallelism)."""
    if tensor_degree(mesh) == 1:
        return None
    return frozenset(a for a in mesh.axis_names if a != TENSOR)


def replicas(mesh: Mesh) -> int:
    """How many pipeline replicas the mesh holds (the product of its data axes)."""
    return int(np.prod([mesh.shape[a] for a in data_axes(mesh)], dtype=int))
