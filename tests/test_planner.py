"""`pj.search`: the delay in effective steps by hand, memory against the compiled step, ranking."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax import planner, staleness
from pipejax.planner import costs as cost_model
from pipejax.bench import peak_bytes
from pipejax.bench.op_costs import op_counts
from pipejax.compile import carried, tensor_share
from tests import llama


@pytest.mark.parametrize("name,K,D", [("pb", 4, 6), ("pb", 8, 14), ("pipedream", 4, 3),
                                      ("pipedream", 8, 7)])
def test_effective_delay_is_computed_by_hand(name, K, D):
    schedule = pj.schedules.make_schedule(name, pj.Placement(K), 2 * K)
    assert max(schedule.delays) == D  # 2(K − 1) for PB, K − 1 for PipeDream
    # eq. 9 from lr 0.1, momentum 0.9, batch 128 at micro-batch 1 and 8:
    # η/(1 − m)·D·b/B = 0.1/0.1·D/128 and 8·D/128
    ref = staleness.effective_delay(schedule, 1, None, 0.0, (0.1, 0.9, 128))
    assert ref == pytest.approx(D / 128)
    assert staleness.effective_delay(schedule, 8, None, 0.0, (0.1, 0.9, 128)) == pytest.approx(
        8 * D / 128)
    # the update's own rate and momentum: 3e-3/(1 − 0.9)·D = 0.03·D
    assert staleness.effective_delay(schedule, 8, 3e-3, 0.9, None) == pytest.approx(0.03 * D)
    assert staleness.effective_delay(schedule, 8, None, 0.0, None) is None
    synchronous = pj.schedules.make_schedule("1f1b", pj.Placement(K), 2 * K)
    assert staleness.effective_delay(synchronous, 8, 3e-3, 0.9, None) == 0.0


def test_the_measured_regimes_fall_on_either_side_of_the_threshold():
    """PB + LWP_D + SC_D on the ResNet at K = 8 (benchmarks/convergence.py):
    eq. 9 from (0.1, 0.9, 128) at micro-batch 1 (delay 0.11: within 2
    points of SGDM) and 8 (0.88: 15 points below); a fixed 3e-3 with
    momentum 0.9 at micro-batch 8 (0.42: 23 points below)."""
    pb = pj.schedules.make_schedule("pb", pj.Placement(8), 32)
    regimes = {0.11: staleness.effective_delay(pb, 1, None, 0.0, (0.1, 0.9, 128)),
               0.88: staleness.effective_delay(pb, 8, None, 0.0, (0.1, 0.9, 128)),
               0.42: staleness.effective_delay(pb, 8, 3e-3, 0.9, None)}
    for measured, delay in regimes.items():
        assert delay == pytest.approx(measured, abs=0.005)
        assert (delay <= staleness.STABLE_DELAY) == (measured == 0.11)
    assert "updates of 2 examples" in staleness.advise(regimes[0.88], 8, (0.1, 0.9, 128))
    assert "synchronous schedule" in staleness.advise(2.0, 1, (0.1, 0.9, 128))


@pytest.mark.parametrize("remat,backward", [(True, 3.0), (False, 2.0)])
def test_gpipes_critical_path_is_counted_by_hand(remat, backward):
    """GPipe at K = 2, M = 2 runs M + K − 1 = 3 ticks of forwards, then 3 of
    backwards; a stage of 3 FLOPs at 1 FLOP/s: forward 1 s, backward 2 s
    (3 s when it recomputes its forward)."""
    schedule = pj.schedules.make_schedule("gpipe", pj.Placement(2), 2)
    costs = cost_model.op_costs([3.0, 3.0], remat)
    assert cost_model.step_seconds(schedule, costs, 1.0, 0.0) == 3 * 1.0 + 3 * backward
    assert cost_model.step_seconds(schedule, costs, 1.0, 0.5) == 3 * 1.0 + 3 * backward + 6 * 0.5
    # both devices on one processor of 1 FLOP/s: all 2 · 2 · (1 + backward) FLOPs in turn
    shared = 2 * 2 * (1.0 + backward)
    assert cost_model.step_seconds(schedule, costs, 1.0, 0.0, host_flops=1.0) == shared
    assert cost_model.step_seconds(schedule, costs, 1.0, 0.0, host_flops=100.0) == 3 + 3 * backward
    # a table that fuses the last stage's forward and backward replays nothing there
    fused = cost_model.op_costs([3.0, 3.0], remat, fused=True)
    assert list(fused[pj.schedules.Op.BW]) == [backward, 2.0]
    # a last stage whose B runs its forward: nothing at the forward's tick, B does it once
    deferred = cost_model.op_costs([3.0, 3.0], remat, w_share=[0.5, 0.5], deferred=True)
    Op = pj.schedules.Op
    assert list(deferred[Op.F]) == [1.0, 0.0] and list(deferred[Op.B]) == [backward - 1.0, 2.0]


@pytest.mark.parametrize("schedule,remat", [("1f1b", "none"), ("zb-h1", "stage")])
def test_ring_traffic_counts_each_row_written_and_read(schedule, remat):
    """Without remat a forward writes its kept residuals and its backward
    reads them (zero bubble's B and W both; 1F1B's last stage, fused, keeps
    none); B writes the bridge and W reads it. At 1 FLOP a byte each op costs its
    rows' bytes."""
    Op = pj.schedules.Op
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=16), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((4, 40)), stages=2, microbatches=4, schedule=schedule,
                       remat=remat)
    code = pipe.build.code
    moved = cost_model.ring_costs(pipe, 1.0)
    kept, bridge = code.kept.slot_bytes(), code.bridge.slot_bytes() if code.bridge else 0
    assert (kept > 0) == (remat == "none") and (bridge > 0) == (schedule == "zb-h1")
    last = 0 if pipe.schedule.fused.any() else kept
    assert list(moved[Op.F]) == list(moved[Op.BW]) == [kept, last]
    assert list(moved[Op.B]) == [kept + bridge, last + bridge]
    assert list(moved[Op.W]) == [kept + bridge, last + bridge]


def test_w_takes_its_share_of_the_backward_as_xla_counts_the_split():
    """W's share of a rematerialized stage's backward is XLA's count of the
    split's W over B's and W's, B's replay of the forward left out: the
    share the compiled ops' counts give, not half; B + W cost BW."""
    Op = pj.schedules.Op
    tokens = jnp.zeros((2, 32), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=2, width=64, heads=2, context=32),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=2,
                       microbatches=4, schedule="zb-h1", remat="stage")
    code = pipe.build.code
    flops = [sum(s.flops for s in pipe.plan.stage_specs(j)) for j in range(code.S)]
    share = cost_model.w_shares(code, flops)
    compiled = op_counts(code)
    for j in range(code.S):
        backward = compiled[Op.B][j] + compiled[Op.W][j] - compiled[Op.F][j]  # less B's replay
        assert share[j] == pytest.approx(compiled[Op.W][j] / backward, rel=0.03)
    assert not np.allclose(share, 0.5, atol=0.02)  # 0.53 and 0.46
    costs = cost_model.op_costs(flops, True, w_share=share)
    assert costs[Op.B] + costs[Op.W] == pytest.approx(costs[Op.BW])
    assert costs[Op.W] == pytest.approx(2 * costs[Op.F] * share)


def test_byte_counts_read_and_bad_ones_are_named():
    from pipejax.formatting import parse_bytes
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("512 MiB") == 2**29
    assert parse_bytes("2e9") == 2_000_000_000 and parse_bytes("1.5GB") == 1_500_000_000
    for bad in ("lots", "-1GiB", "inf"):
        with pytest.raises(pj.errors.ConfigError, match="not a byte count"):
            parse_bytes(bad)


@pytest.fixture(scope="module")
def candidates():
    return planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                          example=jnp.zeros((40,)), machine=planner.Machine(devices=4),
                          training=planner.Training(batch=32, optimizer=optax.adam(1e-3),
                                                    reference=(0.1, 0.9, 128)),
                          space=planner.Space(schedules=["1f1b", "pb"], stages=[2, 4],
                                              microbatches=[4], remat=["stage"]))


def test_candidates_cover_the_grid_ranked_stable_first(candidates):
    seen = {(c.schedule, c.stages, c.data) for c in candidates}
    assert seen == {("1f1b", 2, 2), ("1f1b", 4, 1), ("pb", 2, 2), ("pb", 4, 1)}
    for c in candidates:
        assert c.microbatch * c.microbatches * c.data == 32
        assert (c.effective_delay == 0) == (c.schedule == "1f1b")
    flags = [c.stable is False for c in candidates]
    assert flags == sorted(flags)
    stable = [c.step_seconds for c in candidates if c.stable]
    assert stable == sorted(stable)
    fewer = planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((40,)),
                           machine=planner.Machine(devices=4, memory=min(
                               c.memory_bytes for c in candidates if c.stages == 4)),
                           training=planner.Training(batch=32, optimizer=optax.adam(1e-3)),
                           space=planner.Space(schedules=["1f1b", "pb"], stages=[4],
                                               microbatches=[4], remat=["stage"]))
    assert [c.schedule for c in fewer] == ["1f1b"]  # PB holds more: left out


def test_predicted_memory_is_the_compiled_steps(candidates):
    best = next(c for c in candidates if c.stages == 4 and c.schedule == "pb")
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((best.microbatch, 40)), **best.pipeline_args())
    trainer = pipe.trainer(optax.adam(1e-3))
    assert trainer.memory().total == best.memory_bytes
    state = trainer.init(pipe.init(jax.random.key(0)))
    n = best.microbatches * best.microbatch
    batch = (jnp.zeros((n, 40)), jnp.zeros((n,), jnp.int32))
    compiled = peak_bytes(trainer.step.lower(state, batch).compile())
    assert abs(best.memory_bytes / compiled - 1) < 0.25


def test_an_asynchronous_candidate_on_replicas_is_estimated_as_its_trainer_runs():
    """The search builds one replica, whose trainer has no data rule and so
    updates in the stage switch; on 2 replicas the trainer runs SSGD's mean
    around the switch, which holds the update's result beside the weights
    and state it reads: the candidate's bytes are that trainer's."""
    layers = pj.models.mlp(depth=4, width=64)
    found = planner.search(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((40,)),
                           machine=planner.Machine(devices=4),
                           training=planner.Training(batch=32, optimizer=optax.adam(1e-3)),
                           space=planner.Space(schedules=["pb"], stages=[2], microbatches=[4],
                                               remat=["stage"]))
    c = next(c for c in found if c.data == 2)
    replicated = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                             example=jnp.zeros((c.microbatch, 40)), **c.pipeline_args())
    one = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((c.microbatch, 40)),
                      **{**c.pipeline_args(), "mesh": None})
    assert replicated.trainer(optax.adam(1e-3)).memory().total == c.memory_bytes
    assert one.trainer(optax.adam(1e-3)).memory().total != c.memory_bytes


def test_a_stage_sharded_over_two_devices_is_a_candidate_that_builds_as_ranked():
    found = planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((40,)), machine=planner.Machine(devices=4),
                           training=planner.Training(batch=32, optimizer=optax.adam(1e-3)),
                           space=planner.Space(schedules=["1f1b"], stages=[2], fsdp=[1, 2],
                                               microbatches=[4], remat=["stage"]))
    assert {(c.stages, c.data, c.fsdp) for c in found} == {(2, 2, 1), (2, 1, 2)}
    sharded = next(c for c in found if c.fsdp == 2)
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((sharded.microbatch, 40)), **sharded.pipeline_args())
    assert pipe.build.F == 2 and "2 x 1 x 2 x 1" in planner.render(found)  # K x R x F x T
    trainer = pipe.trainer(optax.adam(1e-3))
    assert trainer.memory().total == sharded.memory_bytes
    state = trainer.init(pipe.init(jax.random.key(0)))
    n = sharded.microbatches * sharded.microbatch
    compiled = peak_bytes(trainer.step.lower(state, (jnp.zeros((n, 40)), jnp.zeros(
        (n,), jnp.int32))).compile())
    assert abs(sharded.memory_bytes / compiled - 1) < 0.25


def test_a_split_over_tensor_is_a_candidate_costed_by_its_annotations():
    """The zoo GPT's Megatron layout: a block's matrices nearly all split,
    two taking a split input (attention's output projection, the MLP's
    second matrix: an all-reduce each); the embedding one (over the
    vocabulary), the head none. A degree the heads do not take is left out."""
    layers = pj.models.gpt(depth=2, width=32, heads=2, context=16, vocab=64)
    tokens = jnp.zeros((16,), jnp.int32)
    found = planner.search(layers, loss=pj.losses.next_token, example=tokens, targets=tokens,
                           machine=planner.Machine(devices=4), training=planner.Training(batch=8),
                           space=planner.Space(schedules=["1f1b"], stages=[4, 2, 1],
                                               tensor=[1, 2, 4], microbatches=[4], remat=["stage"]))
    assert {(c.stages, c.data, c.tensor) for c in found} == {
        (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2)}  # not (1, 1, 4): 2 heads
    split = next(c for c in found if c.tensor == 2 and c.stages == 2)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((2, 16), jnp.int32),
                       targets=jnp.zeros((2, 16), jnp.int32), **split.pipeline_args())
    code = pipe.build.code
    shares = [tensor_share(code, j) for j in range(code.S)]
    assert [rows for _, rows in shares] == [1 + 2, 2 + 0]  # embedding + block, block + head
    assert all(share > 0.9 for share, _ in shares)
    assert "2 x 1 x 1 x 2" in planner.render(found)


def test_on_one_shared_processor_every_split_does_its_arithmetic():
    """At 1 kFLOP/s shared by the 4 devices, arithmetic is all that counts:
    4 stages or 2 stages × 2 replicas run the batch's FLOPs: a forward, its
    replay and a backward of twice its FLOPs on every stage but the last,
    which runs its forward inside its backward (to XLA's counts)."""
    layers = pj.models.mlp(depth=4, width=64)
    found = planner.search(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((40,)),
                           machine=planner.Machine(devices=4, host_flops=1e3),
                           training=planner.Training(batch=32),
                           space=planner.Space(schedules=["1f1b"], stages=[2, 4], microbatches=[4],
                                               remat=["stage"]))
    assert len(found) == 2 and found[0].data * found[0].stages == 4

    def work(stages: int) -> float:
        plan = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((8, 40)),
                           stages=stages, microbatches=4, remat="stage").plan
        flops = [sum(s.flops for s in plan.stage_specs(j)) for j in range(plan.chunks)]
        return 4 * sum(flops) - flops[-1]
    assert found[0].step_seconds / found[1].step_seconds == pytest.approx(
        work(found[0].stages) / work(found[1].stages), rel=1e-3)


def test_replicas_average_their_micro_batches_into_one_update(candidates):
    """PB at K = 2 with 2 replicas: D = 2, updates of 2 × 4 examples."""
    pb = next(c for c in candidates if (c.schedule, c.stages) == ("pb", 2))
    assert (pb.data, pb.microbatch) == (2, 4)
    assert pb.effective_delay == pytest.approx(0.1 / 0.1 * 2 * 8 / 128)


@pytest.mark.parametrize("space,machine,training,message", [
    (dict(stages=[3]), {}, {}, "stages=3 does not divide devices=4"),
    (dict(schedules=["1f1b", "gpip"]), {}, {}, r"schedules \['gpip'\]"),
    (dict(stages=[4], schedules=["1f1b"]), dict(memory=1000), {},
     "no candidate fits memory=1000 B"),
    (dict(schedules=["pb"], stages=[4]), {}, dict(learning_rate=0.1, reference=(0.1, 0.9, 128)),
     "not both"),
    ({}, dict(devices=0), {}, r"Machine\(devices=0\)"),
    ({}, dict(tick_seconds=-1.0), {}, "every rate must be positive"),
    ({}, {}, dict(batch=0), r"Training\(batch=0\)")])
def test_bad_settings_name_themselves(space, machine, training, message):
    with pytest.raises(pj.errors.ConfigError, match=message):
        planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((40,)),
                       machine=planner.Machine(**{"devices": 4, **machine}),
                       training=planner.Training(**{"batch": 32, **training}),
                       space=planner.Space(microbatches=[4], remat=["stage"], **space))


def test_the_search_reports_its_progress():
    calls = []
    found = planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                           example=jnp.zeros((40,)), machine=planner.Machine(devices=4),
                           training=planner.Training(batch=32),
                           space=planner.Space(schedules=["1f1b", "pb"], stages=[2, 4],
                                               microbatches=[4], remat=["stage"]),
                           progress=lambda *a: calls.append(a))
    total = 2 * 2  # stages x schedules, one M and remat each
    assert calls == [(i, total) for i in range(total + 1)] and len(found) == total


def test_an_example_with_a_batch_axis_is_named():
    """The search stacks micro-batches of one example; a batched one does not fit."""
    with pytest.raises(pj.errors.LayerError, match=r"stacked 2 of example \(2, 40\) into each "
                       "micro-batch: give one example, without its batch axis"):
        planner.search(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((2, 40)), machine=planner.Machine(devices=4),
                       training=planner.Training(batch=32),
                       space=planner.Space(stages=[1], microbatches=[4], remat=["stage"]))


def test_messages_cost_the_collectives_the_table_runs():
    """At 1 byte/s over the link and nothing else costed, a step is its
    messages: each collective the table runs (`messages.carried`) sends its
    buffers (`messages.buffers`, checked against the compiled step's
    collective-permutes in test_ring_copies.py): one under GPipe, 1F1B and
    PB, whose on and back take different pairs, two under DualPipeV, whose
    devices pair a forward and a backward at one tick on pairs that carry
    both ways. The ticks GPipe sends nothing one way cost nothing."""
    layers = pj.models.mlp(depth=8, width=64)
    names = ["gpipe", "1f1b", "dualpipev", "pb"]
    found = planner.search(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((40,)),
                           machine=planner.Machine(devices=4, device_flops=1e30,
                                                   link_bandwidth=1.0, tick_seconds=0.0,
                                                   memory_bandwidth=1e30),
                           training=planner.Training(batch=32),
                           space=planner.Space(schedules=names, stages=[4], microbatches=[8],
                                               remat=["stage"]))
    assert {c.schedule for c in found} == set(names)
    for c in found:
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 40)),
                           stages=4, microbatches=8, schedule=c.schedule, virtual=c.virtual)
        per_tick = {"gpipe": 1, "1f1b": 1, "pb": 1, "dualpipev": 2}[c.schedule]
        sends = carried(pipe.schedule).sum() * per_tick
        assert c.step_seconds == pytest.approx(sends * pipe.layout.acts.slot_bytes(), rel=1e-6)
        if c.schedule == "gpipe":  # M + K − 2 ticks send on, as many back, of 2(M + K − 1)
            assert sends == 2 * (8 + 4 - 2)


def test_each_layer_an_op_runs_costs_its_fixed_seconds():
    """At no other cost, a step is its layers' fixed cost: on one stage
    (K = 1, every tick the last stage's forward and backward) each of M
    micro-batches runs every layer's forward and its backward (twice the
    forward's); at K = 2 the critical path, each tick the slowest stage's
    ops, costs its chunk's layers."""
    layers = pj.models.mlp(depth=4, width=64)
    L, M, s = len(layers), 4, 1e-3
    free = planner.Machine(device_flops=1e30, memory_bandwidth=1e30, tick_seconds=0.0,
                           link_bandwidth=1e30, layer_seconds=s, devices=1)
    found = planner.search(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((40,)),
                           machine=free, training=planner.Training(batch=16),
                           space=planner.Space(schedules=["1f1b"], stages=[1], microbatches=[M],
                                               remat=["none", "stage"]))
    assert len(found) == 2
    assert all(c.step_seconds == pytest.approx(M * 3 * L * s) for c in found)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 40)),
                       stages=2, microbatches=M, schedule="gpipe", remat="none")
    fixed = cost_model.fixed_costs(pipe.build.code, False, False, s)
    sizes = [len(pipe.plan.stage_specs(j)) for j in range(2)]
    Op = pj.schedules.Op
    assert list(fixed[Op.F]) == [s * n for n in sizes]
    assert list(fixed[Op.BW]) == [2 * s * n for n in sizes]
    (c,) = planner.search(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((40,)),
                          machine=dataclasses.replace(free, devices=2),
                          training=planner.Training(batch=16),
                          space=planner.Space(schedules=["gpipe"], stages=[2], microbatches=[M],
                                              remat=["none"]))
    # GPipe: M + K − 1 = 5 ticks of forwards, as many of backwards: the first
    # and the last run one stage, the M − 1 between both, as slow as the larger
    assert c.step_seconds == pytest.approx(3 * s * (sum(sizes) + (M - 1) * max(sizes)))


@pytest.mark.slow  # the check itself: tests/compile/test_rendezvous.py
def test_a_tensor_degree_whose_step_would_hang_is_never_proposed():
    """Two heads of 16 over tensor = 4 put a collective-permute in a stage's
    branch (the rotary embedding's halves cross devices): left out at K = 2,
    kept at K = 1, where every device runs the one stage's code."""
    tokens = jnp.zeros((8,), jnp.int32)
    found = planner.search(llama.decoder(width=32, heads=2), loss=pj.losses.next_token,
                           example=tokens, targets=tokens, machine=planner.Machine(devices=8),
                           training=planner.Training(batch=8),
                           space=planner.Space(schedules=["1f1b"], stages=[2, 1], tensor=[2, 4],
                                               microbatches=[2], remat=["stage"]))
    assert {(c.stages, c.tensor) for c in found} == {(2, 2), (1, 2), (1, 4)}
