"""Schedule families: what a schedule's name means, in one registry.

A `Family` is a named way to build tables for any K devices and M
micro-batches, with the facts everything else reads off the name: the
placement it runs on, the virtual stages it takes (and why it refuses
others), whether it is asynchronous, and what `pj.search` tries. As torch's
schedule classes (`ScheduleGPipe`, `ScheduleInterleaved1F1B`) and JaxPP's
schedule objects, a family is an object, not a string compared in many
places: `make_schedule`, `placement_for`, `pj.search`'s candidates, the CLI's
choices and `pj.simulate`'s `delays=` all read `FAMILIES`, and `register`
adds a user's own:

    mine = dataclasses.replace(pj.schedules.FAMILIES["gpipe"], name="mine")
    pj.schedules.register(mine)
    pj.pipeline(layers, ..., schedule="mine")  # its tables are named "mine"
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping

from pipejax.errors import ConfigError, ScheduleError
from pipejax.schedules.asynchronous import pb, pipedream, two_bw
from pipejax.schedules.bubbles import fill_drain, fills_once, pb_fill, zero_bubble_fill
from pipejax.schedules.checks import ONE_CHUNK
from pipejax.schedules.interleaved import gpipe_virtual, interleaved
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.synchronous import gpipe, one_f_one_b
from pipejax.schedules.v_shape import dualpipev, zb_v
from pipejax.schedules.zero_bubble import zb_h1, zb_h2

Builder = Callable[[int, int, int], Schedule]  # (K, M, v) -> table
ClosedForm = Callable[[int, int, int, int], tuple[float, str]]  # (K, M, steps, v) -> bubble


@dataclasses.dataclass(frozen=True)
class Family:
    """A schedule family: its name, how its tables are built, and what it is.

    Attributes:
      name: what `pj.pipeline(schedule=...)` and the CLI call it; its tables
        carry it, and checkpoints store it.
      build: `(K, M, v) -> Schedule` for K devices, M micro-batches and v
        chunks per device (one of `virtuals`).
      placement: "loop" (chunk c of device k is virtual stage c·K + k) or "v"
        (two chunks per device in a V).
      virtual: the chunks per device when none is given.
      virtuals: the chunks per device it runs; None for any.
      refusal: why it does not run the others (said in the error).
      asynchronous: its tables never drain and each stage updates after
        every backward (schedule.py); the build must agree.
      searched: `pj.search` tries it unless told which to try (a copy made
        with `dataclasses.replace` keeps its original's).
      search_virtual: the chunks per device `pj.search` builds it with
        (default `virtual`).
      bubble: the closed form of its tables' bubble over n steps
        (schedules/bubbles.py), which `pipejax bench` checks them against;
        None where none is stated.
      mitigation: the staleness recipe (`pj.transforms.mitigation`) the
        planner's advice names for an asynchronous family's tables (None for
        a synchronous one): "lwp+sc" where the delay grows with depth, the
        default (Kosson et al. 2020: PB, PipeDream); "ef" for 2BW's one-step
        delay (error feedback recovered half of AdamW's delay cost there,
        `benchmarks/async_2bw.py`).
    """

    name: str
    build: Builder
    placement: str = "loop"
    virtual: int = 1
    virtuals: tuple[int, ...] | None = None
    refusal: str = ""
    asynchronous: bool = False
    searched: bool = True
    search_virtual: int | None = None
    bubble: ClosedForm | None = None
    mitigation: str | None = None

    def __post_init__(self):
        if self.search_virtual is None:
            object.__setattr__(self, "search_virtual", self.virtual)
        if self.asynchronous and self.mitigation is None:
            object.__setattr__(self, "mitigation", "lwp+sc")
        if not self.name or self.name.endswith(".csv") or "," in self.name:
            raise ConfigError(f"family name {self.name!r}: give a name that is not empty, has "
                              "no comma and does not end in .csv (the CLI reads those as a "
                              "list or a table's file)")
        if self.placement not in ("loop", "v"):
            raise ConfigError(f"family {self.name!r}: placement {self.placement!r}; use 'loop' "
                              "or 'v'")
        for what, v in (("virtual", self.virtual), ("search_virtual", self.search_virtual)):
            if self.virtuals is not None and v not in self.virtuals:
                raise ConfigError(f"family {self.name!r}: {what}={v} is not one of the "
                                  f"virtuals it runs, {self.virtuals}")

    def runs(self) -> str:
        """The placement it runs on, as the pipeline's arguments say it."""
        return (f"placement={self.placement!r}" if self.placement == "loop"
                else f"placement={self.placement!r} with virtual={self.virtual}")

    def table(self, K: int, M: int, v: int) -> Schedule:
        """Its table for K devices, M micro-batches and v chunks per device
        (checked against `virtuals`), named after the family."""
        if self.virtuals is not None and v not in self.virtuals:
            others = sorted(n for n, f in FAMILIES.items()
                            if f.virtuals is None and f.placement == self.placement)
            raise ConfigError(f"schedule {self.name!r} does not run virtual={v}: "
                              f"{self.refusal}; use virtual={self.virtual}"
                              + (f", or one of {others}" if others else ""))
        table = self.build(K, M, v)
        if table.asynchronous != self.asynchronous:
            raise ScheduleError(f"schedule family {self.name!r} says asynchronous="
                                f"{self.asynchronous}, but its build made a table with "
                                f"asynchronous={table.asynchronous}; make them agree")
        return table if table.name == self.name else dataclasses.replace(table, name=self.name)


def _one_layout(build: Callable[[int, int], Schedule]) -> Builder:
    """A builder of one table per (K, M): `virtuals` names the v it takes."""
    return lambda K, M, v: build(K, M)


_ASYNCHRONOUS = f"asynchronous tables run one chunk per device: {ONE_CHUNK}"


_BUILT_IN = (
    Family("gpipe", lambda K, M, v: gpipe(K, M) if v == 1 else gpipe_virtual(K, M, v),
           bubble=fill_drain),
    Family("1f1b", _one_layout(one_f_one_b), virtuals=(1,),
           refusal="1F1B over virtual stages is 'interleaved'", bubble=fill_drain),
    # Interleaving pays only with chunks to interleave (at v = 1 its table is 1F1B's):
    # built at v = 2 unless told otherwise.
    Family("interleaved", interleaved, virtual=2, bubble=fill_drain),
    Family("zb-h1", zb_h1, bubble=zero_bubble_fill),
    Family("zb-h2", zb_h2, searched=False, bubble=zero_bubble_fill),
    Family("zb-v", _one_layout(zb_v), placement="v", virtual=2, virtuals=(2,),
           refusal="the V places two chunks per device", searched=False),
    Family("dualpipev", _one_layout(dualpipev), placement="v", virtual=2, virtuals=(2,),
           refusal="the V places two chunks per device", searched=False),
    Family("pipedream", _one_layout(pipedream), virtuals=(1,),
           refusal=_ASYNCHRONOUS,
           asynchronous=True, bubble=fills_once),
    Family("pb", _one_layout(pb), virtuals=(1,),
           refusal=_ASYNCHRONOUS,
           asynchronous=True, bubble=pb_fill),
    Family("2bw", _one_layout(two_bw), virtuals=(1,), refusal=_ASYNCHRONOUS,
           asynchronous=True, bubble=fills_once, mitigation="ef"))
_REGISTRY: dict[str, Family] = {family.name: family for family in _BUILT_IN}
FAMILIES: Mapping[str, Family] = types.MappingProxyType(_REGISTRY)  # every schedule by name


def register(family: Family, *, replace: bool = False) -> Family:
    """Add `family` to `FAMILIES`; `replace=True` puts it in the place of
    the family of its name (a built-in one too)."""
    if not isinstance(family, Family):
        raise ConfigError(f"register takes a pj.schedules.Family, not {type(family).__name__}; "
                          "build one with dataclasses.replace(FAMILIES['gpipe'], name=...)")
    if family.name in _REGISTRY and not replace:
        raise ConfigError(f"a family named {family.name!r} is registered; give another name, "
                          "or register(family, replace=True) to replace it")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> Family:
    """Remove the family called `name` from `FAMILIES`, and return it."""
    return _REGISTRY.pop(family(name).name)


def names() -> list[str]:
    """Every family's name, sorted."""
    return sorted(FAMILIES)


def family(name: str) -> Family:
    """The family called `name`, or a clear error naming the others."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown schedule {name!r}; use one of {names()} "
                          "or a pipejax.schedules.Schedule")
    return FAMILIES[name]
