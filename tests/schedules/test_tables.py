"""Schedule tables and the facts derived from them (never hand-written)."""

import matplotlib.image
import numpy as np
import pytest

from pipejax.errors import ConfigError, ScheduleError
from pipejax.placement import Placement
from pipejax.schedules import (NONE, Schedule, bubble_fraction, gpipe, make_schedule, one_f_one_b,
                               pb, pipedream, plot, render, ring_capacities,
                               table_bubble_fraction)
from pipejax.schedules.families import FAMILIES
from pipejax.schedules.tasks import empty, from_lanes

GRID = [(K, M) for K in (2, 4, 8) for M in (K, 2 * K, 4 * K)]


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize("K,M", GRID + [(1, 1), (3, 1), (4, 7)])
def test_synchronous_bubble_is_gpipes(build, K, M):
    s = build(K, M)
    assert s.synchronous and s.ticks == (2 * (M + K - 1) if K > 1 else M)
    assert bubble_fraction(s) == pytest.approx((K - 1) / (M + K - 1), abs=1e-12)
    assert s.delays == [0] * K


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, pb, pipedream])
@pytest.mark.parametrize("K,M", [(1, 1), (1, 4), (2, 4), (4, 8)])
def test_fused_pairs_keep_no_residuals(build, K, M):
    """A stage that runs a micro-batch's backward in the tick of its forward
    (always at K = 1; pipelined backpropagation's last stage) keeps nothing:
    at K = 1 no residual slot at all. PipeDream keeps one op per tick at K > 1."""
    s = build(K, M)
    fused = s.fused
    assert not fused[:, :-1].any()
    if K == 1:
        assert fused[:, 0].all() and ring_capacities(s).residuals == 0
    elif build is pb:
        assert (fused[:, -1] == (s.fwd[:, -1] != NONE)).all() and ring_capacities(s).residuals >= 1
    else:
        assert not fused.any()


@pytest.mark.parametrize("name,K,sends", [("1f1b", 4, 1), ("zb-h1", 4, 1), ("zb-v", 4, 1),
                                           ("dualpipev", 4, 2), ("dualpipev", 8, 1),
                                           ("pb", 2, 2), ("pb", 1, 2)])
def test_message_buffers_a_tick_writes(name, K, sends):
    """PB's stages run a forward and a backward at every tick (at K = 2 the
    first sends its forward's message alone, but its backward writes one
    too) and DualPipeV pairs them at K = 4; the other tables run one of
    them a device a tick (the executor then carries one buffer)."""
    family = FAMILIES[name]
    assert family.table(K, 8, family.search_virtual).messages == sends


def _in_flight(s):
    """Per stage, the most micro-batches between their forward and backward."""
    tl = s.timeline(1)
    return [max(int(np.sum((tl.F[k] <= t) & (tl.B[k] >= t))) for t in range(s.ticks))
            for k in range(s.stages)]


@pytest.mark.parametrize("K,M", GRID)
def test_1f1b_stashes_at_most_K_where_gpipe_stashes_M(K, M):
    slots = ring_capacities(one_f_one_b(K, M))
    assert max(_in_flight(one_f_one_b(K, M))) <= K
    assert slots.inputs <= K and slots.residuals <= K
    assert max(_in_flight(gpipe(K, M))) == M and ring_capacities(gpipe(K, M)).residuals == M


@pytest.mark.parametrize("K,M", GRID)
def test_asynchronous_bubbles_vanish_over_many_steps(K, M):
    for S in (1, 4, 32):
        # PipeDream: one op per stage and tick, exactly (K−1)/(S·M+K−1).
        assert bubble_fraction(pipedream(K, M), S) == pytest.approx(
            (K - 1) / (S * M + K - 1), abs=1e-12)
        # PB: a forward and a backward lane per tick, fill and drain 2K−2 ticks.
        assert bubble_fraction(pb(K, M), S) == pytest.approx(
            (2 * K - 2) / (S * M + 2 * K - 2), abs=1e-12)
    assert bubble_fraction(pb(K, M), 1000) < 0.02


@pytest.mark.parametrize("K,M", GRID + [(1, 3), (8, 1)])
def test_delays_come_from_the_table(K, M):
    assert pipedream(K, M).delays == [K - 1 - k for k in range(K)]
    assert pb(K, M).delays == [2 * (K - 1 - k) for k in range(K)]


@pytest.mark.parametrize("N", range(1, 9))
def test_pipedream_horizons_are_spectrains_eqs_5_and_6(N):
    s = pipedream(N, 4)
    for k in range(N):
        info = s.stage_info(k)
        assert info.forward_horizon == k // 2 + N - k - 1  # eq 5
        assert info.backward_horizon == k // 2  # eq 6
        assert info.delay == N - 1 - k and info.stages == N and info.stage == k


def test_every_micro_batch_runs_once_per_stage_over_steps():
    for s in (pipedream(4, 3), pb(3, 5)):
        tl = s.timeline(5)
        assert (tl.F >= 0).all() and (tl.B >= tl.F).all()
        assert (tl.F[1:] > tl.F[:-1]).all() and (tl.B[:-1] > tl.B[1:]).all()


def test_render_shows_both_lanes():
    text = render(pb(2, 2))
    assert "F0B-2" in text and "F0B0" in text and "delays=[2, 0]" in text
    assert "F2" in render(gpipe(2, 3)) and "bubble=0.250" in render(gpipe(2, 3))


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot(one_f_one_b(4, 8), str(path))
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[1] > image.shape[0] > 50


def _table(rows):
    lanes = {"F": [], "B": []}
    for r in rows:
        for lane in "FB":
            lanes[lane].append([int(c[1:]) if c[0] == lane else NONE for c in r])
    return np.array(lanes["F"]), np.array(lanes["B"])


def test_validate_rejects_a_forward_before_its_input():
    fwd, bwd = _table([["F0", "F0"], ["B0", "."], [".", "B0"]])
    with pytest.raises(ScheduleError, match="tick 0, stage 1 runs the forward of micro-batch 0 "
                                            "before its input exists"):
        Schedule("bad", from_lanes(fwd, bwd), microbatches=1)


def test_validate_rejects_a_backward_before_the_next_stage():
    fwd, bwd = _table([["F0", "."], ["B0", "F0"], [".", "B0"]])
    with pytest.raises(ScheduleError, match="tick 1, stage 0 runs the backward of micro-batch 0 "
                                            "before stage 1 sends its gradient"):
        Schedule("bad", from_lanes(fwd, bwd), microbatches=1)


def test_validate_rejects_a_missing_or_repeated_op():
    fwd, bwd = _table([["F0"], ["F0"], ["B0"]])
    with pytest.raises(ScheduleError, match="runs the forward of micro-batch 0 2 times"):
        Schedule("bad", from_lanes(fwd, bwd), microbatches=1)


def test_user_schedule_must_fit_the_pipeline():
    with pytest.raises(ScheduleError, match=r"built for stages=2 \(the pipeline's 4\)"):
        make_schedule(gpipe(2, 3), Placement(4), 3)
    assert make_schedule(gpipe(2, 3), Placement(2), 3).ticks == 8
    with pytest.raises(Exception, match="unknown schedule"):
        make_schedule("zb-h3", Placement(2), 2)


def test_tables_are_typed_tasks_in_a_forward_and_a_backward_lane():
    from pipejax.schedules import Op

    for build in (gpipe, one_f_one_b, pipedream, pb):
        s = build(3, 4)
        assert s.lanes == 2 and s.lane_ops(0) == (Op.F,) and s.lane_ops(1) == (Op.BW,)
        assert (s.table[..., 2] == 0).all()  # one chunk per device


@pytest.mark.parametrize("K,M", [(2, 1), (3, 4), (4, 2), (5, 3)])
def test_an_asynchronous_table_drains_in_its_lifetime(K, M):
    for s in (pb(K, M), pipedream(K, M)):
        ids = s.table[..., 1][s.table[..., 1] != NONE]
        assert s.drain_periods == s.lifetime == -(ids.min() // M)
        tl = s.timeline(1)  # the step, then the drain: every op of its micro-batches
        assert tl.B.max() < (1 + s.lifetime) * s.ticks <= tl.B.max() + s.ticks


def test_a_split_backward_needs_its_w_after_its_b():
    from pipejax.schedules.tasks import Op, Task, put

    table = gpipe(2, 1).table.copy()
    put(table, 2, 1, 1, Task(Op.B, 0))  # B without a W
    with pytest.raises(ScheduleError, match="weight gradient \\(W or BW\\) of micro-batch 0 0 times"):
        Schedule("zb", table, microbatches=1)
    table = empty(4, 2, 2)
    for t, k, lane, task in ((0, 0, 0, Task(Op.F, 0)), (1, 1, 0, Task(Op.F, 0)),
                             (2, 1, 0, Task(Op.W, 0)), (3, 1, 1, Task(Op.B, 0)),
                             (3, 0, 0, Task(Op.W, 0)), (3, 0, 1, Task(Op.BW, 0))):
        put(table, t, k, lane, task)
    with pytest.raises(ScheduleError, match="weight gradient"):
        Schedule("zb", table, microbatches=1)


def test_a_split_op_reads_what_an_earlier_tick_filed():
    from pipejax.schedules.tasks import Op, Task, put

    def table(b_tick: int, w_tick: int):
        t = empty(3, 1, 3)
        for tick, lane, task in ((0, 0, Task(Op.F, 0)), (b_tick, 1, Task(Op.B, 0)),
                                 (w_tick, 2, Task(Op.W, 0))):
            put(t, tick, 0, lane, task)
        return Schedule("zb", t, microbatches=1)

    assert table(1, 2).ticks == 3
    with pytest.raises(ScheduleError, match="no later than its input gradient"):
        table(1, 1)
    with pytest.raises(ScheduleError, match="in the tick of its forward"):
        table(0, 1)


def test_an_asynchronous_table_with_chunks_is_a_clear_error():
    table = pb(2, 2).table.copy()
    table[0, 0, 0, 2] = 1
    with pytest.raises(ScheduleError, match="asynchronous table with virtual stages"):
        Schedule("v", table, microbatches=2, asynchronous=True)
    with pytest.raises(ConfigError, match="does not run virtual=2"):
        make_schedule("pb", Placement(2, 2), 2)


def test_a_cell_holds_one_forward():
    fwd, bwd = _table([["F0", "."], [".", "F0"], [".", "B0"], ["B0", "."]])
    table = from_lanes(fwd, bwd)
    table[1, 1, 1] = table[1, 1, 0]  # a second forward in the backward lane
    with pytest.raises(ScheduleError, match="tick 1, stage 1 runs two forwards"):
        Schedule("bad", table, microbatches=1)


@pytest.mark.parametrize("K,M", GRID)
def test_the_drawn_table_of_an_asynchronous_schedule_has_no_bubble(K, M):
    """One steady-state period of PB and PipeDream keeps every stage busy in
    every slot (Kosson et al. 2020, §2); a synchronous table is the whole step."""
    assert table_bubble_fraction(pb(K, M)) == 0 == table_bubble_fraction(pipedream(K, M))
    for build in (gpipe, one_f_one_b):
        assert table_bubble_fraction(build(K, M)) == pytest.approx((K - 1) / (M + K - 1))


def test_pictures_name_the_bubble_they_show(monkeypatch, tmp_path):
    """PB's picture is one steady-state period: its bubble, 0, and apart the
    fill/drain bubble of one step, 2(K-1)/(M+2(K-1)) = 6/10 at K = M = 4;
    GPipe's picture is the step with its fill/drain bubble (K-1)/(M+K-1) = 3/7."""
    import matplotlib.axes

    titles = []
    set_title = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda ax, text, **kw: titles.append(text) or set_title(ax, text, **kw))
    plot(pb(4, 4), str(tmp_path / "pb.png"))
    plot(gpipe(4, 4), str(tmp_path / "gpipe.png"))
    async_text = "steady-state bubble=0.000 (fill/drain bubble=0.600 over one step)"
    assert async_text in render(pb(4, 4)) and async_text in titles[0]
    assert "one steady-state period" in titles[0]
    for text in (render(gpipe(4, 4)), titles[1]):
        assert "fill/drain bubble=0.429" in text and "steady-state" not in text
