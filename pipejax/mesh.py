"""The device mesh a pipeline runs on: axis `stage`, one device per stage."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

from pipejax.errors import ConfigError, DeviceError

AXIS = "stage"


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
                              f"jax.make_mesh(({stages},), ('{AXIS}',))")
        if mesh.shape[AXIS] != stages:
            raise ConfigError(f"mesh axis {AXIS!r} has {mesh.shape[AXIS]} devices but "
                              f"stages={stages}; they must be equal")
        unused = [(a, n) for a, n in mesh.shape.items() if a != AXIS and n > 1]
        if unused:
            a, n = unused[0]
            raise ConfigError(
                f"mesh axis {a!r} ({n} devices) is not used by the pipeline: every stage would "
                f"run {n} times on the same data; give a mesh with the single axis {AXIS!r}, e.g. "
                f"jax.make_mesh(({stages},), ('{AXIS}',)) (data parallelism over a second axis "
                "is not supported yet)")
        return mesh
    devices = jax.devices()
    if len(devices) < stages:
        raise DeviceError(
            f"stages={stages} needs {stages} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); on CPU simulate them with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={stages} set before importing jax "
            f"(or pj.simulate_devices({stages}) before any JAX computation), or use fewer stages")
    return Mesh(np.array(devices[:stages]), (AXIS,))
