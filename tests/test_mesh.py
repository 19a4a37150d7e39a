"""Simulated devices and the stage mesh."""

import os
import subprocess
import sys


def test_simulate_devices_never_lowers_the_count_asked_for():
    """XLA_FLAGS asks for 8 devices; a later pj.simulate_devices(2) (the CLI
    calls it) must not leave JAX with 2: JAX's setting overrides the flag.
    More devices than JAX started with is an error that says what to do."""
    code = ("import pipejax as pj, jax\n"
            "pj.simulate_devices(2)\n"
            "print(len(jax.devices()))\n"
            "try:\n    pj.simulate_devices(12)\n"
            "except pj.errors.DeviceError as err:\n    print('initialized with 8' in str(err))")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["8", "True"]
