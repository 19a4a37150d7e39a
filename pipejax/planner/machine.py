"""The machine `pj.search` plans for: its devices, their memory and rates.

The defaults are a GPU's (50 TFLOP/s, 50 GB/s links, 20 µs a tick, 2 TB/s
of memory). Simulated CPU devices share one processor: `host_flops` says
so, and `benchmarks/planner.py --part time` measures it, the rate of its
memory as the rings use it, the tick and a layer's fixed seconds.
"""

from __future__ import annotations

import dataclasses

from pipejax.errors import ConfigError

# The rates in the order `pipejax plan --machine FLOPS,BYTES/S,SECONDS[,HOST[,MEMORY[,LAYER]]]`
# takes them: `Machine(*numbers)`.
RATES = ("device_flops", "link_bandwidth", "tick_seconds", "host_flops", "memory_bandwidth",
         "layer_seconds")


@dataclasses.dataclass(frozen=True)
class Machine:
    """N devices and the rates the step-time model charges (planner/costs.py).

    Attributes:
      device_flops: one device's FLOP/s.
      link_bandwidth: bytes/s between two devices.
      tick_seconds: a tick's fixed cost.
      host_flops: the FLOP/s of the one processor the devices share, if they
        do (simulated CPU devices); None: each has its own.
      memory_bandwidth: bytes/s of a device's memory, as the rings use it.
      layer_seconds: a layer's forward's fixed cost, whatever the
        micro-batch's size (its kernels' launch; its backward's twice that).
      devices: N = data replicas × stages × fsdp × tensor.
      memory: bytes per device; candidates predicted above it are left out.
    """

    device_flops: float = 50e12
    link_bandwidth: float = 50e9
    tick_seconds: float = 20e-6
    host_flops: float | None = None
    memory_bandwidth: float = 2e12
    layer_seconds: float = 0.0
    _: dataclasses.KW_ONLY
    devices: int
    memory: float | None = None

    def __post_init__(self):
        if self.devices < 1:
            raise ConfigError(f"Machine(devices={self.devices}): give at least one device")
        rates = {name: getattr(self, name) for name in RATES}
        may_be_0 = ("tick_seconds", "layer_seconds")  # fixed costs; the others divide
        bad = {n: r for n, r in rates.items()
               if r is not None and (r < 0 or r == 0 and n not in may_be_0)}
        if bad:
            raise ConfigError(f"Machine: {bad}; every rate must be positive (tick_seconds and "
                              "layer_seconds may be 0: no fixed cost; host_flops None: no "
                              "processor shared)")
