"""--machine: the machine `pj.search` assumes, from numbers or from the JSON
a GPU's `pipejax bench --only gpu` wrote."""

from __future__ import annotations

import json
from pathlib import Path

from pipejax.cli.setup import parse_numbers


def machine_rates(machine: str | None, dtype: str) -> dict:
    """`pj.search`'s machine from --machine: its numbers, or the device rate a
    `pipejax bench --only gpu` JSON measured in `dtype` (one GPU has no link
    to measure: the link and the tick keep their defaults)."""
    if machine is None:
        return {}
    if machine.endswith(".json"):
        from pipejax.bench.gpu import measured_flops
        from pipejax.errors import ConfigError  # pipejax imports JAX: only when asked

        try:
            result = json.loads(Path(machine).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--machine {machine}: cannot read it as JSON ({e}); give the "
                              f"bench_gpu.json that `make gpu` wrote") from None
        flops, device = measured_flops(result, dtype)
        print(f"device rate {flops / 1e12:.1f} TFLOP/s ({dtype}, {device}, the plain jit's "
              f"model FLOP/s in {machine}); link and tick: the defaults (one GPU has no link "
              f"to measure)")
        return {"device_flops": flops}
    rates = parse_numbers(machine, "--machine", (3, 4), "50e12,50e9,20e-6")
    return dict(zip(("device_flops", "link_bandwidth", "tick_seconds", "host_flops"), rates))
