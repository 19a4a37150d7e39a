"""The table interpreter updates its rings in place: no tick of any
synchronous table copies a ring buffer, a ring's row, a message or a
weight-sized buffer, counted in the compiled step's text
(`pipejax.bench.hlo.tick_copies`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.bench import hlo
from pipejax.schedules import FAMILIES
from tests.cases import fast_and_slow

SYNCHRONOUS = [name for name, family in FAMILIES.items() if not family.asynchronous]


# Every table keeps residuals in rings without remat; with it, the slow tests.
CASES = [(s, r) for s in SYNCHRONOUS for r in ("none", "stage")]


@pytest.mark.parametrize("schedule,remat", fast_and_slow(
    CASES, [c for c in CASES if c[1] == "none"], ids=lambda c: f"{c[0]}-{c[1]}"))
def test_no_tick_copies_a_ring_or_the_weights(schedule, remat):
    """The zoo GPT (4 layers) on K = 2 devices, M = 4, AdamW: no copy of
    a ring, of a ring's row (activation-sized: a message, one micro-batch's
    kept residuals) or of the weights."""
    tokens = jnp.zeros((2, 16), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=2, width=32, heads=2, context=16),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=2,
                       microbatches=4, schedule=schedule, remat=remat)
    trainer = pipe.trainer(optax.adamw(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((8, 16), jnp.int32),) * 2
    text = trainer.step.lower(state, batch).compile().as_text()
    ticks = pipe.schedule.ticks
    found = hlo.tick_copies(text, ticks, hlo.buffer_shapes(pipe.layout))
    assert found == {"tick": [], "loops": []}, found


@pytest.mark.parametrize("schedule", fast_and_slow(["zb-v", "dualpipev"], ["zb-v"]))
def test_a_v_tick_runs_two_collectives(schedule):
    """A V's messages go down, up and round the turn, both ways: the
    payloads along equal pairs share one collective-permute, and which task
    sent them is read off the table, so a tick at K = 4 runs two, as a
    loop's does (four with a collective per way, more with the task's
    scalars sent too)."""
    pipe = pj.pipeline(pj.models.mlp(depth=8, width=32), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((4, 40)), stages=4, microbatches=8, schedule=schedule)
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((32, 40)), jnp.zeros((32,), jnp.int32))
    text = trainer.step.lower(state, batch).compile().as_text()
    assert hlo.per_tick(text, pipe.schedule.ticks, "collective-permute") == {"tick": 2, "step": 0}
