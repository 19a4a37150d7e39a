"""GPipe's table, the facts derived from it, and the validation of tables."""

import numpy as np
import pytest

from pipejax.errors import ScheduleError
from pipejax.schedules import BWD, FWD, IDLE, Schedule, gpipe, make_schedule


@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("M", [1, 2, 4, 7, 16])
def test_bubble_fraction_is_gpipes(K, M):
    s = gpipe(K, M)
    assert s.ticks == 2 * (M + K - 1)
    assert s.bubble_fraction == pytest.approx((K - 1) / (M + K - 1), abs=1e-12)
    assert s.stage_info(K - 1).delay == 0


def test_every_stage_runs_each_microbatch_forward_then_backward():
    s = gpipe(4, 6)
    F, B = s.tick_of(FWD), s.tick_of(BWD)
    assert (F >= 0).all() and (B > F).all()
    assert (F[1:] > F[:-1]).all() and (B[:-1] > B[1:]).all()


def test_gpipe_stashes_every_microbatch():
    s = gpipe(4, 8)
    assert s.input_capacity == 8 and s.residual_capacity == 8
    assert s.grad_capacity == 1  # a gradient is used at the tick after it arrives


def test_render_shows_the_timeline():
    text = gpipe(2, 3).render()
    assert "stage 0" in text and "stage 1" in text and "F2" in text and "B0" in text
    assert "bubble=0.250" in text


def _table(rows):
    ops = np.array([[{"F": FWD, "B": BWD, ".": IDLE}[c[0]] for c in r] for r in rows])
    mb = np.array([[int(c[1:]) if len(c) > 1 else 0 for c in r] for r in rows])
    return ops, mb


def test_validate_rejects_a_forward_before_its_input():
    ops, mb = _table([["F0", "F0"], ["B0", "."], [".", "B0"]])
    with pytest.raises(ScheduleError, match="tick 0, stage 1 runs the forward of micro-batch 0 "
                                            "before its input exists"):
        Schedule("bad", ops, mb, microbatches=1)


def test_validate_rejects_a_backward_before_the_next_stage():
    ops, mb = _table([["F0", "."], ["B0", "F0"], [".", "B0"]])
    with pytest.raises(ScheduleError, match="tick 1, stage 0 runs the backward of micro-batch 0 "
                                            "before stage 1 sends its gradient"):
        Schedule("bad", ops, mb, microbatches=1)


def test_validate_rejects_a_missing_or_repeated_op():
    ops, mb = _table([["F0"], ["F0"], ["B0"]])
    with pytest.raises(ScheduleError, match="runs F of micro-batch 0 2 times"):
        Schedule("bad", ops, mb, microbatches=1)


def test_user_schedule_must_fit_the_pipeline():
    with pytest.raises(Exception, match="built for K=2, M=3"):
        make_schedule(gpipe(2, 3), 4, 3)
    assert make_schedule(gpipe(2, 3), 2, 3).ticks == 8
