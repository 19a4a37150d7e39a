"""Virtual-stage and zero-bubble tables: the bubble read off each table equals its closed
form, chunks go round the devices, B precedes its W, and the stash each
table needs is what the papers say."""

import matplotlib.image
import numpy as np
import pytest

from pipejax.bench.bubbles import bubble_formula
from pipejax.errors import ConfigError, ScheduleError
from pipejax.placement import Placement
from pipejax.schedules import (Op, bubble_fraction, in_flight, make_schedule, one_f_one_b, plot,
                               render, ring_capacities)

SHAPES = [(K, M, v) for K in (2, 4, 8) for M in (K, 2 * K, 4 * K) for v in (1, 2, 3)]


@pytest.mark.parametrize("name", ["gpipe", "interleaved", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("K,M,v", SHAPES)
def test_bubble_from_the_table_equals_the_closed_form(name, K, M, v):
    s = make_schedule(name, Placement(K, v), M)
    formula, _ = bubble_formula(name, K, M, 1, v)
    assert bubble_fraction(s) == pytest.approx(formula, abs=1e-12)
    zb = name.startswith("zb")
    assert s.ticks == (3 * v * M + K - 1 if zb else 2 * (v * M + K - 1))


@pytest.mark.parametrize("K,M,v", [(2, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_chunks_go_round_the_devices(K, M, v):
    """Device k runs chunk c as virtual stage c·K + k; a micro-batch's forward
    visits them in order, one tick apart at best, round the ring."""
    s = make_schedule("interleaved", Placement(K, v), M)
    tl = s.timeline()
    assert tl.F.shape == (K * v, M)
    assert (np.diff(tl.F, axis=0) >= 1).all() and (np.diff(tl.B, axis=0) <= -1).all()
    first_round = tl.F[:, 0]  # micro-batch 0 meets no queue: one tick a virtual stage
    assert list(first_round) == list(range(K * v))


@pytest.mark.parametrize("K,v", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_warms_up_as_torch_does(K, v):
    """Device k runs (v−1)·K + 2·(K−1−k) forwards before its first backward
    (ScheduleInterleaved1F1B); at v = 1 the table is 1F1B."""
    M = 2 * K
    s = make_schedule("interleaved", Placement(K, v), M)
    for k in range(K):
        ops = [o for o in s.ops[:, k, 0] if o != Op.IDLE]
        assert ops.index(Op.BW) == min((v - 1) * K + 2 * (K - 1 - k) + 1, v * M)
    assert (make_schedule("interleaved", Placement(K), M).table == one_f_one_b(K, M).table).all()


@pytest.mark.parametrize("K,M", [(2, 4), (4, 8), (8, 16)])
def test_zero_bubble_stash_and_order(K, M):
    """ZB-H1 holds 1F1B's residual slots; ZB-H2 about twice (2K − 1); every
    W runs after its B, and B and W together cover each backward once."""
    h1, h2, base = (make_schedule(n, Placement(K), M) for n in ("zb-h1", "zb-h2", "1f1b"))
    assert ring_capacities(h1).residuals == ring_capacities(base).residuals == K
    assert ring_capacities(h2).residuals == 2 * K - 1
    assert in_flight(h1, 0) == in_flight(base, 0) == K
    for s in (h1, h2):
        tl = s.timeline()
        assert (tl.W > tl.B).all() and ring_capacities(s).bridge >= 1
        assert set(np.unique(s.ops)) == {Op.IDLE, Op.F, Op.B, Op.W}


def test_pictures_name_f_b_w_and_chunks(tmp_path):
    text = render(make_schedule("zb-h1", Placement(4), 8))
    assert "W0" in text and "B0" in text and "green W weight gradient" in text
    text = render(make_schedule("interleaved", Placement(2, 2), 4))
    assert "F0.1" in text and "K=2 v=2" in text and "m.c = micro-batch m on chunk c" in text
    plot(make_schedule("interleaved", Placement(4, 2), 8), str(tmp_path / "il.png"))
    assert matplotlib.image.imread(tmp_path / "il.png").shape[1] > 600


def test_names_that_do_not_take_chunks():
    with pytest.raises(ConfigError, match="1F1B over virtual stages is 'interleaved'"):
        make_schedule("1f1b", Placement(2, 2), 4)
    with pytest.raises(ScheduleError, match=r"is built for virtual=2 \(the pipeline's 1\)"):
        make_schedule(make_schedule("gpipe", Placement(2, 2), 4), Placement(2), 4)
