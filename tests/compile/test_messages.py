"""Which collectives a tick runs, read off the table (`messages.carried`)."""

import numpy as np
import pytest

from pipejax.compile.messages import carried, collectives
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


@pytest.mark.parametrize("name", ["zb-v", "dualpipev"])
def test_a_v_sends_nothing_at_its_turn_nor_from_weight_gradients(name):
    """A V's turn (chunk K − 1 to chunk K) stays on its device, and W sends
    nothing: a tick whose only ops are those runs no collective, and every
    tick with an op that sends off its device runs one."""
    K = 4
    s = make_schedule(name, placement_for(name, K, None, None), 8)
    busy = carried(s).any(1)
    pl, ops = s.placement, s.ops
    for t in range(s.ticks):
        leaves = False
        for k in range(K):
            for op, g, c in s.table[t, k]:
                j = pl.chunk(k, c)
                target = j + 1 if op == Op.F else j - 1
                if op in (Op.F, Op.B, Op.BW) and 0 <= target < pl.chunks:
                    leaves |= pl.device(target) != k
        assert busy[t] == leaves, (t, s.table[t])
    assert not busy.all() and (ops == Op.W).any()
