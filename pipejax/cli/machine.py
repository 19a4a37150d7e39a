"""--machine: the machine `pj.search` assumes, from numbers, from the JSON
a GPU's `pipejax bench --only gpu` wrote, or measured here (host)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipejax.cli.setup import parse_numbers
from pipejax.errors import ConfigError
from pipejax.planner import RATES, Machine


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


def machine(text: str | None, dtype: str, devices: int, memory: float | None) -> Machine:
    """`pj.search`'s machine of `devices` devices from --machine: its
    numbers (a HOST of 0: no processor shared), or the device rate a
    `pipejax bench --only gpu` JSON measured in `dtype` (one GPU has no link
    to measure: the link and the tick keep their defaults), or this
    machine's, measured ("host": `pipejax.planner.host`)."""
    if text == "host":
        from pipejax.planner.host import measure

        m = dataclasses.replace(measure(devices), memory=memory)
        print(f"measured here on {devices} simulated devices: {m.host_flops / 1e9:.3g} GFLOP/s "
              f"shared, {m.link_bandwidth / 1e9:.3g} GB/s links, {m.tick_seconds * 1e6:.3g} µs "
              f"a tick, {m.memory_bandwidth / 1e9:.3g} GB/s of memory, "
              f"{m.layer_seconds * 1e6:.3g} µs a layer")
        return m
    if text is None:
        d = Machine(devices=devices, memory=memory)
        print(f"predicted for pj.search's default machine, a GPU ({d.device_flops / 1e12:g} "
              f"TFLOP/s, {d.link_bandwidth / 1e9:g} GB/s links, {d.tick_seconds * 1e6:g} "
              f"µs a tick, {d.memory_bandwidth / 1e12:g} TB/s of memory); --machine gives "
              "yours")
        return d
    if text.lower().endswith(".json"):
        flops, device = measured_flops(Path(text), dtype)
        print(f"device rate {flops / 1e12:.1f} TFLOP/s ({dtype}, {device}, the plain jit's "
              f"model FLOP/s in {text}); link and tick: the defaults (one GPU has no link "
              f"to measure)")
        return Machine(flops, devices=devices, memory=memory)
    numbers = parse_numbers(text, "--machine", tuple(range(3, len(RATES) + 1)),
                            "50e12,50e9,20e-6")
    given = dict(zip(RATES, numbers))
    if given.get("host_flops") == 0:  # none shared
        given["host_flops"] = None
    try:
        return Machine(**given, devices=devices, memory=memory)
    except ConfigError:
        raise ConfigError(f"--machine {text}: every rate must be positive (SECONDS, HOST "
                          f"and LAYER may be 0: no fixed cost a tick, no processor shared, no "
                          f"fixed cost a layer), e.g. "
                          f"50e12,50e9,20e-6,0,2e12,0") from None
