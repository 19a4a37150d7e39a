"""Virtual stages and zero bubble on the one interpreter: virtual stages (interleaved, GPipe
over chunks) and the zero-bubble split (B, W) give the sequential model's
loss and gradients, W reuses what B computed (no forward again, the fused
backward's FLOPs), and a device's chunks unstage into layer order."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.bench.op_costs import op_counts, step_count
from pipejax.planner.paths import executed
from pipejax.compile.residuals import costly
from pipejax.compile.split import _needed
from pipejax.errors import ConfigError
from pipejax.placement import Placement
from pipejax.schedules import Op, make_schedule
from pipejax.trace import cost_analysis
from tests.cases import fast_and_slow
from tests.reference import batch, heterogeneous_layers, rel_err, sequential_value_and_grad

MB = 2
# At v = 1 the gpipe and interleaved tables are GPipe's and 1F1B's (test_schedules.py;
# the tables' equality: tests/schedules/test_virtual_and_zero_bubble_tables.py).
GRID = [(s, K, v) for s in ("interleaved", "gpipe", "zb-h1", "zb-h2") for K in (2, 4)
        for v in (1, 2) if not (s in ("gpipe", "interleaved") and v == 1)]
GRID += [("zb-h1", 1, 1), ("zb-h2", 1, 1)]  # one lane of F, B and W with no idle cell


def _pipe(schedule: str, K: int, v: int, M: int = 4, **kw) -> pj.Pipeline:
    return pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=K, microbatches=M,
                       schedule=schedule, virtual=v, **kw)


@pytest.mark.parametrize("schedule,K,v,M", fast_and_slow(
    [(*c, 4) for c in GRID] + [("zb-h1", 2, 2, 3)],
    fast=[("zb-h1", 2, 2, 3), ("zb-h1", 1, 1, 4)]))  # interleaved: the trainer test
def test_new_schedules_equal_sequential(schedule, K, v, M):
    # remat "none" on the zero-bubble tables: W then reads kept residuals through the bridge
    # (at K = 1 a scalar residual keeps its shape in its slot).
    remat = "none" if schedule.startswith("zb") and K <= 2 else "stage"
    pipe = _pipe(schedule, K, v, M, remat=remat)
    assert pipe.plan.chunks == K * v and pipe.schedule.placement.virtual == v
    params = pipe.init(jax.random.key(1))
    x, y = batch(M * MB)
    key = jax.random.key(2)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    layers = heterogeneous_layers()
    ref_loss, ref_grads = sequential_value_and_grad(layers, M)(pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def test_chunks_sit_round_the_devices_and_unstage_in_layer_order():
    pipe = _pipe("interleaved", 2, 2)
    plan = pipe.plan
    assert [plan.placement.device(j) for j in range(4)] == [0, 1, 0, 1]
    assert plan.device_layers(0) == [*plan.ranges[0], *plan.ranges[2]]
    params = pipe.init(jax.random.key(0))
    values = pj.unstage(params)
    one = pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                      example=jnp.zeros((MB, 20)), stages=1, microbatches=4)
    # Layer i is initialized from fold_in(key, i) wherever it sits.
    assert rel_err(values, pj.unstage(one.init(jax.random.key(0)))) == 0
    assert rel_err(pj.unstage(pipe.stage(values)), values) == 0
    assert "device" in str(plan) and "circular placement" in str(plan)


def test_w_reuses_what_b_computed():
    """B and W run disjoint parts of one backward but for the elementwise
    and layout equations W runs again between the bridge and its reads;
    together they are the fused backward's equations, none of the
    forward's, and cost its FLOPs and those equations' (on these small
    stages, mostly elementwise, up to a tenth more), so a zero-bubble step
    executes 1F1B's FLOPs within 5 % (from table × op costs)."""
    for remat in ("none", "stage"):
        pipe = _pipe("zb-h1", 2, 1, remat=remat)
        for split in pipe.build.code.splits:
            shared = [split.nodes[i] for i in set(split.b) & set(split.w)]
            assert all(not costly(node.primitive, **node.params) for node in shared)
            whole = _needed(split.nodes, [*split.b_outs, *split.w_outs], set())
            assert sorted({*split.b, *split.w}) == whole
            assert len(split.bridge) > 0 and split.w  # the weight path waits in the bridge
        costs = op_counts(pipe.build.code)
        for j in range(pipe.build.code.S):
            b_w = costs[Op.B][j] + costs[Op.W][j]
            assert 0.999 * costs[Op.BW][j] <= b_w <= 1.1 * costs[Op.BW][j], (remat, j)
        one_f_one_b = make_schedule("1f1b", Placement(2), 4)
        ratio = executed(pipe.schedule, costs) / executed(one_f_one_b, costs)
        assert abs(ratio - 1) < 0.05, (remat, ratio)


def test_a_step_counts_a_fused_pair_as_its_one_vjp():
    """At K = 1, 1F1B runs each micro-batch's forward and backward as one
    vjp, the plain jit's work: `step_count` gives M times its FLOPs, not
    F + BW's, which with remat "stage" replay the forward (4/3 of them).
    zb-h1 keeps the forward's residuals in a ring and files the bridge:
    more bytes."""
    M, layers = 4, heterogeneous_layers()
    one = _pipe("1f1b", 1, 1, M=M, remat="stage")
    x, y = batch(MB)

    def loss(v):
        return pj.losses.cross_entropy(pj.apply_layers(layers, v, x, jax.random.key(0)), y)
    variables = pj.unstage(one.init(jax.random.key(0)))
    plain = cost_analysis(jax.jit(jax.value_and_grad(loss)).lower(variables).compile())["flops"]
    assert step_count(one.schedule, one.build.code) == pytest.approx(M * plain, rel=0.05)
    zb = _pipe("zb-h1", 1, 1, M=M, remat="none")
    moved = lambda pipe: step_count(pipe.schedule, pipe.build.code, "bytes accessed")
    assert moved(zb) > moved(one)


@pytest.mark.parametrize("remat", ["stage", pytest.param("none", marks=pytest.mark.slow)])
def test_the_last_stages_backward_runs_its_forward_where_it_keeps_nothing(remat):
    """With remat "stage" the last stage keeps nothing for its backward,
    which would replay its forward: the backward runs the forward instead
    (compile/last_stage.py; 1F1B's BW as one vjp, zb-h1's B as its split),
    so a step executes a stage's forward a micro-batch less than F and a
    replay did, zb-h1 1F1B's FLOPs within 5 %, and each micro-batch's loss
    comes from its backward. With remat "none" the forward keeps its residuals at its
    own tick."""
    M, Op = 4, pj.schedules.Op
    zb, one = (_pipe(name, 2, 1, M=M, remat=remat) for name in ("zb-h1", "1f1b"))
    assert zb.build.code.deferred == one.build.code.deferred == (remat == "stage")
    ratio = step_count(zb.schedule, zb.build.code) / step_count(one.schedule, one.build.code)
    assert ratio == pytest.approx(1.0, abs=0.05)  # W's remade equations (test above)
    if remat == "stage":  # F + BW, replaying, against the one vjp on the last stage
        counts, code = op_counts(one.build.code), one.build.code
        params, h, feed, _, _ = code.backward_args(1)
        pair = cost_analysis(jax.jit(code.pair).lower(params, h, feed).compile())["flops"]
        replayed = M * (counts[Op.F][1] + counts[Op.BW][1])
        assert step_count(one.schedule, code) == pytest.approx(
            executed(one.schedule, counts) - replayed + M * pair)
        assert M * pair < 0.8 * replayed
    x, y = batch(M * MB)
    losses = []
    for pipe in (zb, one):
        trainer = pipe.trainer(optax.sgd(1e-2))
        state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(3))
        losses.append(trainer.step(state, (x, y))[1]["losses"])
    assert rel_err(losses[0], losses[1]) < 1e-5 and bool(jnp.isfinite(losses[0]).all())


def _split(layers: list, partition: tuple[int, ...], stage: int):
    """Stage `stage`'s B/W split of `layers` over len(partition) stages,
    zb-h1, remat "none"."""
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=len(partition), microbatches=4, schedule="zb-h1", remat="none",
                       partition=partition)
    code = pipe.build.code
    return code.splits[code.groups.of[stage]]


def test_the_first_stage_runs_its_cotangents_in_b():
    """The first stage has no input gradient to send, yet its B runs the
    cotangents' chain through it and its W the weight gradients alone, as on
    the other stages: [Dense, relu, Dense] | [Dense]: B one matmul (the
    second Dense's input gradient), W two (each Dense's weight gradient)."""
    split = _split([nn.Dense(32), nn.relu, nn.Dense(16), nn.Dense(10)], (3, 1), stage=0)
    dots = lambda part: sum(split.nodes[i].primitive.name == "dot_general" for i in part)
    assert (dots(split.b), dots(split.w)) == (1, 2)
    assert sorted(a.shape for a in split.avals) == [(MB, 16), (MB, 32)]


def test_the_bridge_carries_cotangents_and_w_makes_the_gelu_again():
    """The middle stage of [Dense] | [Dense(32), tanh GELU, Dense(16)] |
    [Dense] under remat "none": B files the cotangents of its two Dense
    outputs; W makes the GELU it multiplies by again from the kept Dense
    output and the kept tanh (a transcendental runs once, in the forward)."""
    split = _split([nn.Dense(20), nn.Dense(32), jax.nn.gelu, nn.Dense(16), nn.Dense(10)],
                   (1, 3, 1), stage=1)
    assert sorted(a.shape for a in split.avals) == [(MB, 16), (MB, 32)]
    again = {split.nodes[i].primitive.name for i in set(split.b) & set(split.w)}
    assert "mul" in again and "tanh" not in again


def test_the_bridge_holds_a_layer_norms_cotangent_once():
    """The middle stage of [Dense] | [LayerNorm, Dense(16)] | [Dense] under
    remat "none": W sums the norm's output cotangent dy for its bias and
    dy·x̂ for its scale; the bridge files dy alone (the least bytes), and W
    makes dy·x̂ again, not both."""
    split = _split([nn.Dense(20), nn.LayerNorm(), nn.Dense(16), nn.Dense(10)], (1, 2, 1),
                   stage=1)
    assert sorted(a.shape for a in split.avals) == [(MB, 16), (MB, 20)]


@pytest.mark.slow  # their tables equal the sequential model in test_new_schedules_equal_sequential
def test_a_trainer_steps_on_interleaved_and_zero_bubble_tables_as_on_one_stage():
    x, y = batch(4 * MB)
    losses = {}
    for schedule, K, v in (("gpipe", 1, 1), ("interleaved", 2, 2), ("zb-h1", 2, 2)):
        pipe = _pipe(schedule, K, v)
        trainer = pipe.trainer(optax.adam(1e-2))
        state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(3))
        run = []
        for _ in range(2):
            state, m = trainer.step(state, (x, y))
            run.append(float(m["loss"]))
        losses[schedule] = (run, pj.unstage(state.params))
        assert trainer.memory().total > 0
    for name in ("interleaved", "zb-h1"):
        assert rel_err(losses[name][0], losses["gpipe"][0]) < 1e-5
        assert rel_err(losses[name][1], losses["gpipe"][1]) < 1e-5


def test_a_callback_in_the_backward_runs_once_in_b():
    calls = []

    def noisy(x):
        @jax.custom_vjp
        def f(x):
            return x

        f.defvjp(lambda x: (x, None), lambda _, g: (jax.debug.callback(calls.append, 1) or g,))
        return f(x)

    layers = [*heterogeneous_layers()[:2], noisy, *heterogeneous_layers()[2:]]
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=2, microbatches=2, schedule="zb-h1", partition=[7, 7])
    params = pipe.init(jax.random.key(0))
    jax.block_until_ready(pipe.value_and_grad(params, batch(2 * MB), jax.random.key(1)))
    assert len(calls) == 2  # once per micro-batch


def test_virtual_stages_errors_name_the_setting():
    with pytest.raises(ConfigError, match="'interleaved'"):
        _pipe("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="asynchronous tables run one chunk per device"):
        _pipe("pipedream", 2, 2)
    with pytest.raises(ConfigError, match="stages × virtual = 14 > 13 layers"):
        _pipe("interleaved", 7, 2)
    with pytest.raises(ConfigError, match="virtual=0"):
        _pipe("interleaved", 2, 0)
    with pytest.raises(ConfigError, match="max_bytes bounds each stage"):
        _pipe("interleaved", 2, 2, max_bytes=1e9)
    with pytest.raises(ConfigError, match="needs stages >= 2"):
        _pipe("interleaved", 1, 2)
    with pytest.raises(ConfigError, match="multiple of stages \\(M=6, K=4\\).*use M=8"):
        _pipe("interleaved", 4, 2, M=6)
    with pytest.raises(ConfigError, match="give one layer count per chunk, 4 in model order"):
        _pipe("interleaved", 2, 2, partition=[7, 6])
    with pytest.raises(ConfigError, match="max_padding bounds the padding"):
        _pipe("gpipe", 2, 2, max_padding=0.5)
    assert np.isfinite(pj.schedules.bubble_fraction(_pipe("zb-h1", 2, 1, M=3).schedule))


def test_a_table_of_fused_and_split_backwards_runs():
    # Stage 1 fuses its backward (BW), stage 0 splits it (B, then W), as DualPipeV's drain does.
    from pipejax.schedules.tasks import Task, empty, put

    table = empty(5, 2, 1)
    for t, k, task in ((0, 0, Task(Op.F, 0)), (1, 1, Task(Op.F, 0)), (2, 1, Task(Op.BW, 0)),
                       (3, 0, Task(Op.B, 0)), (4, 0, Task(Op.W, 0))):
        put(table, t, k, 0, task)
    pipe = _pipe(pj.Schedule("mixed", table, microbatches=1), 2, 1, M=1)
    params = pipe.init(jax.random.key(1))
    x, y = batch(MB)
    loss, grads = pipe.value_and_grad(params, (x, y), jax.random.key(2))
    ref_loss, ref_grads = sequential_value_and_grad(heterogeneous_layers(), 1)(
        pj.unstage(params), x, y, jax.random.key(2))
    assert rel_err(loss, ref_loss) < 1e-5 and rel_err(pj.unstage(grads), ref_grads) < 1e-5
