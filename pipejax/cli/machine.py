"""--machine: the machine `pj.search` assumes, from numbers or from the JSON
a GPU's `pipejax bench --only gpu` wrote."""

from __future__ import annotations

import json
from pathlib import Path

from pipejax.cli.imports import defaults
from pipejax.cli.setup import parse_numbers
from pipejax.errors import ConfigError


def measured_flops(path: Path, dtype: str) -> tuple[float, str]:
    """The plain jit's model FLOP/s in `dtype` from a `bench_gpu.json`, and
    the device it ran on."""
    try:
        section = json.loads(path.read_text())["gpu"]
        rows, device = section.get(dtype, []), section["device_kind"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--machine {path}: not the JSON of a GPU bench ({type(e).__name__}: "
                          f"{e}); give the bench_gpu.json that `make gpu` wrote") from None
    plain = next((r for r in rows if r.get("step") == "plain jit" and "ms" in r), None)
    if plain is None:
        raise ConfigError(f"--machine {path}: no measured plain jit in {dtype} (its dtypes: "
                          f"{[d for d in ('bfloat16', 'float32') if section.get(d)]}); run "
                          f"`make gpu` on the GPU, or give --machine FLOPS,BYTES/S,SECONDS")
    return 1e12 * plain["model_tflops"], device


def machine_rates(machine: str | None, dtype: str) -> dict:
    """`pj.search`'s machine from --machine: its numbers (a HOST of 0: no
    processor shared), or the device rate a `pipejax bench --only gpu` JSON
    measured in `dtype` (one GPU has no link to measure: the link and the
    tick keep their defaults)."""
    if machine is None:
        from pipejax.planner import search

        d = defaults(search)
        print(f"predicted for pj.search's default machine, a GPU ({d['device_flops'] / 1e12:g} "
              f"TFLOP/s, {d['link_bandwidth'] / 1e9:g} GB/s links, {d['tick_seconds'] * 1e6:g} "
              f"µs a tick, {d['memory_bandwidth'] / 1e12:g} TB/s of memory); --machine gives "
              "yours")
        return {}
    if machine.lower().endswith(".json"):
        flops, device = measured_flops(Path(machine), dtype)
        print(f"device rate {flops / 1e12:.1f} TFLOP/s ({dtype}, {device}, the plain jit's "
              f"model FLOP/s in {machine}); link and tick: the defaults (one GPU has no link "
              f"to measure)")
        return {"device_flops": flops}
    rates = dict(zip(("device_flops", "link_bandwidth", "tick_seconds", "host_flops",
                      "memory_bandwidth", "layer_seconds"),
                     parse_numbers(machine, "--machine", (3, 4, 5, 6), "50e12,50e9,20e-6")))
    may_be_0 = ("host_flops", "layer_seconds")
    if any(r < 0 or r == 0 and name not in may_be_0 for name, r in rates.items()):
        raise ConfigError(f"--machine {machine}: every rate must be positive (HOST and LAYER "
                          f"may be 0: no processor shared, no fixed cost a layer), e.g. "
                          f"50e12,50e9,20e-6,0,2e12,0")
    return {name: r for name, r in rates.items() if r}  # 0: none shared, none counted
