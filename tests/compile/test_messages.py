"""Which collectives a tick runs, read off the table (`messages.carried`)."""

import numpy as np
import pytest

from pipejax.compile.messages import buffers, carried, collectives
from pipejax.schedules import Op, gpipe, make_schedule, placement_for


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (8, 8)])
def test_gpipe_sends_on_while_it_runs_forward_and_back_after(K, M):
    """GPipe's forwards fill ticks 0 … M + K − 2, the last stage's sending
    nothing on; the backwards the next M + K − 1 ticks, the first stage's
    sending nothing back: each way's collective runs M + K − 2 ticks, never
    at a tick of the other's."""
    s = gpipe(K, M)
    busy = carried(s)
    assert busy.shape == (s.ticks, len(collectives(s.placement))) == (2 * (M + K - 1), 2)
    on, back = busy.T
    assert on.sum() == back.sum() == M + K - 2
    assert on[:M + K - 2].all() and not on[M + K - 2:].any()
    assert back[M + K - 1:-1].all() and not (on & back).any()


def _reference(s) -> np.ndarray:
    """`carried` by hand: each sending task's pairs, looked up in the
    placement's routes one cell at a time."""
    pl, pairs = s.placement, collectives(s.placement)
    out = np.zeros((s.ticks, len(pairs)), bool)
    for t in range(s.ticks):
        for k in range(pl.stages):
            for op, g, c in s.table[t, k]:
                step = 1 if op == Op.F else -1 if op in (Op.B, Op.BW) else 0
                target = pl.chunk(k, c) + step
                if step == 0 or not 0 <= target < pl.chunks or pl.device(target) == k:
                    continue  # W, idle, the first and last chunks' sends, a V's turn
                shift = (pl.device(target) - k) % pl.stages
                route = next(r for r in pl.routes(step) if r.shift == shift)
                assert (k, pl.device(target)) in route.pairs
                out[t, pairs.index(tuple(route.pairs))] = True
    return out


@pytest.mark.parametrize("name,K,v", [("zb-v", 4, None), ("dualpipev", 4, None),
                                      ("zb-v", 2, None), ("interleaved", 4, 2),
                                      ("interleaved", 2, 2), ("1f1b", 2, None),
                                      ("pb", 4, None), ("pipedream", 4, None)])
def test_each_collective_runs_where_a_task_sends_along_its_pairs(name, K, v):
    """Down and up a V (its turn stays on a device), round a loop of
    virtual stages (the last device's chunk sends to the first's next),
    two devices whose ways share their pairs, asynchronous tables (whose
    steady period sends both ways at every tick)."""
    s = make_schedule(name, placement_for(name, K, v, None), 8)
    busy = carried(s)
    assert (busy == _reference(s)).all()
    assert busy.any(0).all() and (s.asynchronous or not busy.all())  # an async period is full


@pytest.mark.parametrize("name,K,v,expected", [("zb-v", 4, None, [1, 1]),
                                               ("dualpipev", 4, None, [2, 2]),
                                               ("dualpipev", 8, None, [1, 1]),
                                               ("pb", 4, None, [1, 1]),
                                               ("interleaved", 2, 2, [1])])
def test_a_collective_sends_a_buffer_for_each_way_along_its_pairs(name, K, v, expected):
    """A V's down and up pairs carry both ways: one shared buffer (zb-v),
    or two where a device runs a forward and a backward at one tick
    (DualPipeV at K = 4); a loop's on and back go different ways, one
    buffer each (PB, whose devices run both at every tick), except on two
    devices with virtual stages, where the ring's pairs serve both ways."""
    s = make_schedule(name, placement_for(name, K, v, None), 8)
    assert buffers(s).tolist() == expected
