"""The table interpreter updates its rings in place: no tick of any
synchronous table copies a ring buffer, a ring's row, a message or a
weight-sized buffer, counted in the compiled step's text
(`pipejax.bench.hlo.tick_copies`); and a tick sends its messages after its
last op (`hlo.tick_order`)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.bench import hlo
from pipejax.compile.messages import buffers
from pipejax.schedules import FAMILIES
from tests.cases import fast_and_slow

SYNCHRONOUS = [name for name, family in FAMILIES.items() if not family.asynchronous]


# Every table keeps residuals in rings without remat; a plain one and a V one (its W split) run
# fast, the others and remat "stage" in the slow tests.
CASES = [(s, r) for s in SYNCHRONOUS for r in ("none", "stage")]


@pytest.mark.parametrize("schedule,remat", fast_and_slow(
    CASES, [(s, "none") for s in ("1f1b", "zb-v")], ids=lambda c: f"{c[0]}-{c[1]}"))
def test_no_tick_copies_a_ring_or_the_weights(schedule, remat):
    """The zoo GPT (4 layers) on K = 2 devices, M = 4, AdamW: no copy of
    a ring, of a ring's row (activation-sized: a message, one micro-batch's
    kept residuals) or of the weights."""
    assert _copies(schedule, remat, stages=2) == {"tick": [], "loops": []}


def test_a_bridge_row_of_a_size_one_axis_is_not_copied():
    """Zero bubble on one device, remat "stage": W reads per-token values
    of shape (2, 16, 1) from a one-slot bridge. Filed with their size-1
    axis, XLA laid the ring out anew and copied it at every tick (20
    copies); filed without it, none."""
    assert _copies("zb-h1", "stage", stages=1) == {"tick": [], "loops": []}


@pytest.mark.parametrize("schedule", fast_and_slow(["1f1b", "zb-h1"], ["1f1b"]))
def test_a_tick_sends_after_its_last_op(schedule):
    """Every op's loop hands on the tick's messages, so both sends follow
    the last loop: sent after the loop that wrote it, a message made a
    device whose op came later wait at that send for the other devices'
    ops before it (a tick took the sum of its devices' ops)."""
    text, pipe = _compiled(schedule, "none", stages=2)
    order = hlo.tick_order(text, pipe.schedule.ticks)
    assert order.count("send") == 2 and order.count("loop") >= 2
    assert order[-2:] == ["send", "send"], order


def _copies(schedule: str, remat: str, stages: int) -> dict[str, list[int]]:
    text, pipe = _compiled(schedule, remat, stages)
    return hlo.tick_copies(text, pipe.schedule.ticks, hlo.buffer_shapes(pipe.layout))


def _compiled(schedule: str, remat: str, stages: int) -> tuple[str, pj.Pipeline]:
    """The compiled step's text of the zoo GPT (4 layers) and its pipeline."""
    tokens = jnp.zeros((2, 16), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=2, width=32, heads=2, context=16),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=stages,
                       microbatches=4, schedule=schedule, remat=remat)
    trainer = pipe.trainer(optax.adamw(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((8, 16), jnp.int32),) * 2
    return trainer.step.lower(state, batch).compile().as_text(), pipe


@pytest.mark.parametrize("schedule", fast_and_slow(["zb-v", "dualpipev", "pb"], ["zb-v"]))
def test_a_tick_runs_two_collectives_of_the_buffers_it_sends(schedule):
    """A V's messages go down, up and round the turn, both ways: the
    payloads along equal pairs share one collective-permute, and which task
    sent them is read off the table, so a tick at K = 4 runs two, as a
    loop's does (four with a collective per way, more with the task's
    scalars sent too). Each carries one message where a device sends one a
    tick (zb-v), two where it sends a pair (DualPipeV), one along each of a
    loop's ways (PB, which sends a pair): what `messages.buffers` says and
    the planner charges."""
    pipe = pj.pipeline(pj.models.mlp(depth=8, width=32), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((4, 40)), stages=4, microbatches=8, schedule=schedule)
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((32, 40)), jnp.zeros((32,), jnp.int32))
    text = trainer.step.lower(state, batch).compile().as_text()
    assert hlo.per_tick(text, pipe.schedule.ticks, "collective-permute") == {"tick": 2, "step": 0}
    sent = re.findall(r"= \(?f32\[([\d,]+)\][^=]*? collective-permute(?:-start)?\(", text)
    message = 4 * 32  # a micro-batch of 4 at width 32
    expected = {"zb-v": [1, 1], "dualpipev": [2, 2], "pb": [1, 1]}[schedule]
    assert buffers(pipe.schedule).tolist() == expected
    assert [math.prod(map(int, dims.split(","))) for dims in sent] == [
        n * message for n in expected]


_TICKS = """\
ENTRY %main (p: (s32[], f32[4,8,16])) -> (s32[], f32[4,8,16]) {
  %w = (s32[], f32[4,8,16]) while(%p), condition=%cond, body=%tick, \
backend_config={"known_trip_count":{"n":"6"}}
}
%tick (q: (s32[], f32[4,8,16])) -> (s32[], f32[4,8,16]) {
  %get-tuple-element.1 = f32[4,8,16]{2,1,0} get-tuple-element(%q), index=1
  %copy.1 = f32[4,8,16]{2,1,0} copy(%get-tuple-element.1)
  %copy_bitcast_fusion.1 = f32[16,32]{1,0} fusion(%get-tuple-element.1), kind=kLoop, \
calls=%turned
  %copy_bitcast_fusion.2 = f32[8,16]{1,0} fusion(%get-tuple-element.1), kind=kLoop, \
calls=%row
}
%turned (a: f32[4,8,16]) -> f32[16,32] {
  %param_0 = f32[4,8,16]{2,1,0} parameter(0)
  %transpose.1 = f32[16,4,8]{0,2,1} transpose(%param_0), dimensions={2,0,1}
}
%row (a: f32[4,8,16]) -> f32[8,16] {
  %param_0 = f32[4,8,16]{2,1,0} parameter(0)
  %dynamic-slice.1 = f32[1,8,16]{2,1,0} dynamic-slice(%param_0, %c, %c, %c)
}
"""


def test_the_count_tells_a_copied_ring_from_a_read_row_and_a_turned_operand():
    """A copy of a carried ring counts; a fusion that slices a row out (a
    read) or transposes what it copies (a dot's operand laid out, as a
    plain jit does) does not."""
    assert hlo.tick_copies(_TICKS, 6) == {"tick": [4 * 8 * 16 * 4], "loops": []}
