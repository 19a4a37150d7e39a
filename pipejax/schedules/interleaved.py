"""Virtual stages (Narayanan et al. 2021, §2.2): each device holds v model
chunks, device k chunks c = 0..v−1 (virtual stages c·K + k, circular
placement), so a micro-batch goes round the devices v times and the
fill/drain bubble shrinks v-fold: (K−1)/(v·M+K−1) of the slots, at the
price of v times the messages. Micro-batches go round in groups of K
(`greedy.rounds`); with M a multiple of K the table reaches the closed form.

- interleaved 1F1B: device k warms up with (v−1)·K + 2·(K−1−k) forwards
  (torch's ScheduleInterleaved1F1B, Megatron-LM), then alternates a forward
  and a fused backward, then drains; at v = 1 it is 1F1B.
- GPipe with v chunks: all forwards round by round, then all backwards.
Both take 2·(v·M+K−1) ticks when K divides M.
"""

from __future__ import annotations

from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules.greedy import in_order, rounds
from pipejax.schedules.schedule import Schedule
from pipejax.schedules.tasks import Op, Task


def check_virtual(name: str, K: int, M: int, v: int) -> None:
    """Virtual stages need K ≥ 2 devices to go round and v ≥ 1 chunks."""
    if K < 1 or M < 1 or v < 1:
        raise ConfigError(f"{name} needs K >= 1 stages, M >= 1 micro-batches and v >= 1 chunks, "
                          f"got K={K}, M={M}, v={v}")
    if v > 1 and K < 2:
        raise ConfigError(f"{name} with virtual={v} needs stages >= 2: on one device its chunks "
                          "run one after the other, with nothing to overlap; use virtual=1 on "
                          "one stage")


def _forwards(K: int, M: int, v: int) -> list[Task]:
    return [Task(Op.F, m, c) for m, c in rounds(K, M, v)]


def _backwards(K: int, M: int, v: int) -> list[Task]:
    return [Task(Op.BW, m, c) for m, c in rounds(K, M, v, backward=True)]


def interleaved(K: int, M: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (at v = 1, `one_f_one_b`)."""
    check_virtual("interleaved", K, M, v)
    if v == 1:
        from pipejax.schedules.synchronous import one_f_one_b

        table = one_f_one_b(K, M).table
        return Schedule("interleaved", table, microbatches=M)
    if M % K:
        raise ConfigError(f"interleaved with virtual={v} needs microbatches a multiple of "
                          f"stages (M={M}, K={K}): its warm-up counts whole rounds of K "
                          f"micro-batches (Megatron-LM and torch ask the same); use M="
                          f"{-(-M // K) * K}, or schedule 'gpipe' or 'zb-h1', which take any M")
    orders = []
    for k in range(K):
        fwd, bwd = _forwards(K, M, v), _backwards(K, M, v)
        warm = min((v - 1) * K + 2 * (K - 1 - k), v * M)
        order = fwd[:warm]
        for i in range(v * M - warm):
            order += [fwd[warm + i], bwd[i]]
        orders.append(order + bwd[v * M - warm:])
    placement = Placement(K, v)
    return Schedule("interleaved", in_order("interleaved", placement, M, orders), M,
                    placement=placement)


def gpipe_virtual(K: int, M: int, v: int) -> Schedule:
    """GPipe over v chunks per device: every forward, then every backward."""
    check_virtual("gpipe", K, M, v)
    order = _forwards(K, M, v) + _backwards(K, M, v)
    placement = Placement(K, v)
    return Schedule("gpipe", in_order("gpipe", placement, M, [order] * K), M,
                    placement=placement)
