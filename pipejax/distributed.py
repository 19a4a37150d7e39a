"""Several processes, one mesh: `jax.distributed` for pipejax, and a local launcher.

Every process runs the same program (JAX is multi-controller): it joins the
job with `initialize`, after which `jax.devices()` lists the devices of all
processes, in process order, and `pj.make_mesh` lays one global mesh over
them; each process feeds the same batch and holds the shards of the state on
its own devices. With 2 processes of 2 devices each, a 4-stage pipeline has
stages 0–1 in process 0 and stages 2–3 in process 1, and the activations
cross between them through the CPU collectives of gloo.

- One machine: `launch(command, N)` (`pipejax train --processes N`) starts N
  processes and tells each its part through the environment.
- Several hosts: run the same command on every host with
  PIPEJAX_COORDINATOR=host0:port (process 0's host, a free port),
  PIPEJAX_PROCESSES=N and PIPEJAX_PROCESS_ID=i (0 on host0), and on CPU
  PIPEJAX_LOCAL_DEVICES=devices per process.
- A GPU cluster: one process per host (it sees that host's GPUs), the same
  three variables, or none of them under SLURM or Open MPI, whose own
  variables `jax.distributed.initialize()` reads; NCCL carries the
  collectives and PIPEJAX_LOCAL_DEVICES is ignored.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from pipejax.errors import DeviceError

ENV = ("PIPEJAX_COORDINATOR", "PIPEJAX_PROCESSES", "PIPEJAX_PROCESS_ID", "PIPEJAX_LOCAL_DEVICES")
# XLA:CPU's Eigen kernels on the calling thread: with the process pinned to
# one core (every thread it starts inherits the core), a stage computes on
# its own core alone, as on its own GPU.
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def launched() -> bool:
    """Whether this process was started as one of several (the variables are set)."""
    return "PIPEJAX_COORDINATOR" in os.environ


def initialize(coordinator: str | None = None, processes: int | None = None,
               process_id: int | None = None, local_devices: int | None = None) -> None:
    """Join the job of several processes; call before any JAX computation.

    Arguments default to the PIPEJAX_* variables `launch` sets. On CPU each
    process gets `local_devices` simulated devices and talks to the others
    through gloo; on GPUs the devices are the host's and NCCL is used.
    """
    import jax

    env = os.environ
    coordinator = coordinator or env.get("PIPEJAX_COORDINATOR")
    processes = processes or int(env.get("PIPEJAX_PROCESSES", "0")) or None
    if process_id is None and "PIPEJAX_PROCESS_ID" in env:
        process_id = int(env["PIPEJAX_PROCESS_ID"])
    local_devices = local_devices or int(env.get("PIPEJAX_LOCAL_DEVICES", "0")) or None
    pin()
    if local_devices:
        jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id)


def pin() -> None:
    """Pin this process to the core PIPEJAX_CORE names (`launch(pinned=True)`),
    if any; before XLA starts its threads, which inherit the core."""
    if "PIPEJAX_CORE" in os.environ:
        os.sched_setaffinity(0, {int(os.environ["PIPEJAX_CORE"])})


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator will)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def devices_per_process(devices: int, processes: int) -> int:
    """`devices` split evenly over `processes`, or a clear error."""
    if processes < 1 or devices % processes:
        raise DeviceError(f"{devices} devices (replicas x stages) do not split evenly over "
                          f"{processes} processes; use a process count that divides {devices}")
    return devices // processes


def child_flags(pinned: bool) -> str:
    """This process's XLA_FLAGS for a process it starts: without a forced
    device count (each simulates its own devices; the count would override
    them), and on one thread where `pinned`."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return f"{flags} {ONE_THREAD}".strip() if pinned else flags


def launch(command: Sequence[str], processes: int, local_devices: int, timeout: float = 600.0,
           quiet_others: bool = True, port: int | None = None, pinned: bool = False) -> int:
    """Run `command` as `processes` local processes of one job and wait.

    Each gets PIPEJAX_COORDINATOR (localhost and `port`, default a free
    one), PIPEJAX_PROCESSES,
    PIPEJAX_PROCESS_ID and PIPEJAX_LOCAL_DEVICES; with `pinned`, process i
    also gets PIPEJAX_CORE = i (mod the cores), which `initialize` pins it
    to, and XLA:CPU runs on one thread (`ONE_THREAD`): an idle device is an
    idle core, as on GPUs. If one fails or the
    `timeout` (seconds) passes, the others are killed with their children,
    so no process and no port outlive the call. Output of processes other
    than 0 is discarded when `quiet_others`. Returns the first non-zero exit
    status, or 0.
    """
    port = port or free_port()
    children = []
    flags, cores = child_flags(pinned), sorted(os.sched_getaffinity(0))
    try:
        for i in range(processes):
            env = dict(os.environ, XLA_FLAGS=flags, PIPEJAX_COORDINATOR=f"localhost:{port}",
                       PIPEJAX_PROCESSES=str(processes), PIPEJAX_PROCESS_ID=str(i),
                       PIPEJAX_LOCAL_DEVICES=str(local_devices))
            if pinned:
                env["PIPEJAX_CORE"] = str(cores[i % len(cores)])
            out = subprocess.DEVNULL if quiet_others and i else None
            children.append(subprocess.Popen(list(command), env=env, stdout=out, stderr=out,
                                             start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [c.poll() for c in children]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"pipejax: {processes} processes still running after {timeout:.0f} s; "
                      "stopping them", file=sys.stderr)
                return 124
            time.sleep(0.05)
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, signal.SIGKILL)
                c.wait()
