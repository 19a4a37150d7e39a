"""The pinned-core benchmark's yardsticks: a table's ideal step from its
ops' times, and a process's share of a step in collectives."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pipejax as pj
from pipejax.bench.collective_time import collective_share
from pipejax.planner.paths import coupled_path, earliest_path
from pipejax.bench.op_times import ideal_seconds, key
from pipejax.schedules import Op

K, M, F, BW, UPDATE = 2, 4, 1.0, 2.0, 0.5


def _pipe(schedule: str, remat: str = "none"):
    x = jnp.zeros((4, 8))
    return pj.pipeline(pj.models.mlp(depth=4, width=8), loss=pj.losses.cross_entropy, example=x,
                       targets=jnp.zeros(4, jnp.int32), stages=K, microbatches=M,
                       schedule=schedule, remat=remat, mesh=pj.make_mesh(K))


def _seconds(pipe, split: bool = False) -> dict[str, float]:
    """Every stage's F and BW (and, `split`, B and W of half BW each) at
    the same time, the last stage's pair as F + BW."""
    out = {key("update", k): UPDATE for k in range(K)}
    for j in range(pipe.build.code.S):
        out.update({key(Op.F, j): F, key(Op.BW, j): BW})
        if split:
            out.update({key(Op.B, j): BW / 2, key(Op.W, j): BW / 2})
    out[key("pair", pipe.build.code.S - 1)] = F + BW
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_ideal_step_of_a_flushed_table_is_its_closed_form(schedule):
    """Equal stages: (M + K − 1) forwards and backwards on the critical
    path, then the update."""
    pipe = _pipe(schedule)
    assert ideal_seconds(pipe, _seconds(pipe)) == pytest.approx((M + K - 1) * (F + BW) + UPDATE)


def test_a_last_stage_whose_backward_runs_its_forward_waits_for_every_forward_in_gpipe():
    """remat "stage": GPipe's last stage runs each forward in its backward
    (the pair), after the first stage's last forward: M forwards, M pairs,
    then the first stage's last backward."""
    pipe = _pipe("gpipe", "stage")
    assert pipe.build.code.deferred
    assert ideal_seconds(pipe, _seconds(pipe)) == pytest.approx(M * F + M * (F + BW) + BW + UPDATE)


def test_zero_bubble_is_ideally_faster_than_1f1b_by_what_its_w_fills():
    """zb-h1 moves W into 1F1B's bubble: with W half of the backward its
    ideal step is shorter, and never shorter than every op of a device."""
    one, zero = _pipe("1f1b"), _pipe("zb-h1")
    slower, faster = ideal_seconds(one, _seconds(one)), ideal_seconds(zero, _seconds(zero, True))
    assert M * (F + BW) + UPDATE <= faster < slower


def test_a_device_waiting_for_its_peer_spends_its_step_in_the_collective():
    """Device 0 works while device 1 waits for its message: a large share of
    the traced calls is collective time, and never more than all of it."""
    mesh = jax.make_mesh((2,), ("stage",))

    def body(a):
        work = lambda b: jax.lax.fori_loop(0, 40, lambda _, c: jnp.tanh(c @ c), b)
        a = jax.lax.cond(jax.lax.axis_index("stage") == 0, work, lambda b: b, a)
        return jax.lax.ppermute(a, "stage", [(0, 1), (1, 0)])
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("stage"), out_specs=P("stage")))
    a = jax.device_put(jnp.ones((2 * 256, 256)) / 256, NamedSharding(mesh, P("stage")))
    step(a).block_until_ready()
    share = collective_share(lambda: step(a).block_until_ready(), lambda: None)
    assert 0.2 < share <= 1.0


def _slow_second_chunk(pipe) -> dict[str, float]:
    """Every op at `_seconds`' times but chunk 1's backward three times slower."""
    last = pipe.build.code.S - 1
    seconds = {**_seconds(pipe), key(Op.BW, 1): 3 * BW}
    if last == 1:
        seconds[key("pair", 1)] = F + 3 * BW
    return seconds


def test_one_way_collectives_wait_only_for_the_input():
    """1F1B with a slower last stage: in lock step every tick waits for it;
    its collectives each go one way, so as the executor couples its devices
    each op waits only for its input."""
    pipe = _pipe("1f1b")
    seconds = _slow_second_chunk(pipe)
    lock = ideal_seconds(pipe, seconds, partial(earliest_path, lockstep=True))
    assert ideal_seconds(pipe, seconds, coupled_path) == ideal_seconds(pipe, seconds) < lock


def test_a_ring_of_two_waits_for_the_peer_at_every_tick():
    """Interleaved at K = 2: a collective each tick both ways round a ring of
    two, so a device waits for its peer's tick even where the message is
    not needed yet: slower than each op waiting for its input, and at most
    the lock step."""
    pipe = _pipe("interleaved")
    seconds = _slow_second_chunk(pipe)
    lock = ideal_seconds(pipe, seconds, partial(earliest_path, lockstep=True))
    assert ideal_seconds(pipe, seconds) < ideal_seconds(pipe, seconds, coupled_path) <= lock


def test_an_asynchronous_stage_updates_after_each_backward():
    """PipeDream never drains: at most every op of the busiest device, its
    M forwards, M backwards and M updates, and never less than those."""
    pipe = _pipe("pipedream", "stage")
    busiest = M * (F + BW + UPDATE)
    assert busiest <= ideal_seconds(pipe, _seconds(pipe)) <= busiest + (K - 1) * (F + BW)
