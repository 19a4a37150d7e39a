"""The device mesh a pipeline runs on: axis `stage`, one device per stage,
and optional data axes, one pipeline replica per index of them.

A mesh ("stage",) runs one pipeline; ("data", "stage") runs one replica per
data index; ("node", "local", "stage") groups the replicas for hierarchical
rules (H-ADPSGD). `AXES` says what each axis name means; a mesh with any
other name is an error (pipejax would otherwise have to guess what it is
for). The replicas are numbered row-major over the data axes, in mesh order.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax.errors import ConfigError, DeviceError

AXIS = "stage"
# Every axis name a pipeline's mesh may have, and what it means.
AXES = {AXIS: "the pipeline's stages, one device each",
        "data": "pipeline replicas (data parallelism)",
        "node": "groups of replicas (hierarchical rules: H-ADPSGD, elastic over nodes)",
        "local": "the replicas within a node"}
DATA_AXES = ("data", "node", "local")  # the axes whose indices are replicas


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
        if AXIS not in mesh.axis_names:
            raise ConfigError(f"mesh axes {tuple(mesh.axis_names)} have no {AXIS!r} axis; "
                              f"name the pipeline axis {AXIS!r}, e.g. "
                              f"pj.make_mesh({stages}), or jax.sharding.Mesh(devices, ('data', '{AXIS}'))")
        unknown = [a for a in mesh.axis_names if a not in AXES]
        if unknown:
            known = "; ".join(f"{name!r}: {meaning}" for name, meaning in AXES.items())
            raise ConfigError(f"mesh axes {tuple(mesh.axis_names)}: pipejax does not know "
                              f"{', '.join(map(repr, unknown))} (a stage runs on one device: "
                              f"sharding a stage over more is not supported); its axes are "
                              f"{known}")
        if mesh.shape[AXIS] != stages:
            raise ConfigError(f"mesh axis {AXIS!r} has {mesh.shape[AXIS]} devices but "
                              f"stages={stages}; they must be equal")
        # shard_map places the pipeline's buffers itself: Auto axes (jax.make_mesh
        # makes Explicit ones, which would ask every input to arrive pre-sharded).
        return Mesh(mesh.devices, mesh.axis_names)
    return make_mesh(stages)


def make_mesh(stages: int, data: int = 1, nodes: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of data × stages devices (default: `jax.devices()`, those of
    every process): axes ("stage",) for data = 1, ("data", "stage"), or
    ("node", "local", "stage") with `nodes` groups of data / nodes replicas
    (hierarchical rules). Each replica's stages are consecutive devices, the
    stage axis the fastest."""
    for name, n in (("stages", stages), ("data", data), ("nodes", nodes)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ConfigError(f"{name}={n!r}; use a positive integer")
    if data % nodes:
        raise ConfigError(f"data={data} replicas do not split into nodes={nodes} equal groups; "
                          f"use a multiple of {nodes}")
    devices, need = list(devices or jax.devices()), data * stages
    if len(devices) < need:
        where = (f"{jax.process_count()} processes with {jax.local_device_count()} each"
                 if jax.process_count() > 1 else devices[0].platform)
        what = f"{data} replicas x {stages} stages need" if data > 1 else f"stages={stages} needs"
        raise DeviceError(
            f"{what} {need} devices but JAX sees {len(devices)} ({where}); on CPU simulate them with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} set before importing jax "
            f"(or pj.simulate_devices({need}) before any JAX computation), or use fewer stages "
            "or replicas")
    grid = np.array(devices[:need])
    if nodes > 1:
        return Mesh(grid.reshape(nodes, data // nodes, stages), ("node", "local", AXIS))
    if data > 1:
        return Mesh(grid.reshape(data, stages), ("data", AXIS))
    return Mesh(grid, (AXIS,))


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data axes (`DATA_AXES`), in mesh order."""
    return tuple(a for a in mesh.axis_names if a in DATA_AXES)


def replicas(mesh: Mesh) -> int:
    """How many pipeline replicas the mesh holds (the product of its data axes)."""
    return int(np.prod([mesh.shape[a] for a in data_axes(mesh)], dtype=int))
