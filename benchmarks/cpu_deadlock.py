"""The XLA CPU deadlock that `pipejax.compile.guard` prevents, reproduced.

A standalone reproducer, no pipejax: a `shard_map` program with one collective
(`ppermute` or `psum`) over N simulated CPU devices, called in a tight loop of
asynchronous dispatches, each call fed the previous output. `--trial` runs
one such loop; it exits 0 when every call finished and 1 when its watchdog
saw it hang. Without arguments the script runs a grid of trials in subprocesses
(programs in flight capped at c by waiting for call i − c before dispatching
call i; "none" = no cap) and prints which hang, then writes
`results/cpu_deadlock.json`.

What triggers it (see the guard's docstring for the mechanism): more than 32
programs with a collective in flight at once, the per-device admission limit
of XLA's CPU client, on a machine with no more cores than devices.

Run: python benchmarks/cpu_deadlock.py            # the grid, about 3 minutes
     python benchmarks/cpu_deadlock.py --trial --devices 4 --in-flight 0   # hangs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CALLS, WATCHDOG = 3000, 20.0


def trial(devices: int, in_flight: int, collective: str) -> None:
    """One loop of CALLS dispatches; in_flight = 0 means no cap."""
    import faulthandler

    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("stage",))
    ring = [(i, (i + 1) % devices) for i in range(devices)]

    def body(w, h):
        h = jnp.tanh(h[0] @ w[0])
        if collective == "ppermute":
            h = lax.ppermute(h, "stage", ring)
        elif collective == "psum":
            h = lax.psum(h, "stage")
        return h[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("stage"), P("stage")),
                              out_specs=P("stage"), check_vma=False))
    sharded = NamedSharding(mesh, P("stage"))
    w = jax.device_put(jnp.broadcast_to(0.5 * jnp.eye(64), (devices, 64, 64)), sharded)
    h = jax.device_put(jnp.ones((devices, 16, 64)), sharded)
    jax.block_until_ready(f(w, h))
    faulthandler.dump_traceback_later(WATCHDOG, exit=True)  # exit code 1 when hung
    outs = []
    for i in range(CALLS):
        if in_flight and len(outs) >= in_flight:
            outs[-in_flight].block_until_ready()
        h = f(w, h)
        outs = (outs + [h])[-64:]
    jax.block_until_ready(h)
    faulthandler.cancel_dump_traceback_later()


def grid() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from common import save, table

    cases = [(4, c, "ppermute") for c in (0, 64, 33, 32, 31, 2)] + \
            [(4, 0, "psum"), (4, 0, "none"), (2, 0, "ppermute"), (8, 0, "ppermute"),
             (8, 32, "ppermute"), (8, 2, "ppermute")]
    rows = []
    for devices, cap, collective in cases:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, __file__, "--trial", "--devices", str(devices),
                              "--in-flight", str(cap), "--collective", collective],
                             capture_output=True, text=True, timeout=WATCHDOG + 120)
        rows.append({"devices": devices, "collective": collective,
                     "in_flight": cap or "none", "calls": CALLS,
                     "result": "ok" if run.returncode == 0 else "HANG",
                     "seconds": round(time.perf_counter() - start, 1)})
        print(rows[-1], flush=True)
    print(table(rows))
    print(f"cores: {os.cpu_count()}; a hang = the {WATCHDOG:.0f} s watchdog fired")
    print(f"wrote {save('cpu_deadlock', {'rows': rows, 'calls': CALLS, 'watchdog_s': WATCHDOG})}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trial", action="store_true", help="run one loop")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=0, help="cap on calls in flight; 0: none")
    parser.add_argument("--collective", default="ppermute", choices=["ppermute", "psum", "none"])
    args = parser.parse_args()
    if args.trial:
        trial(args.devices, args.in_flight, args.collective)
    else:
        grid()


if __name__ == "__main__":
    main()
