"""A stage sharded over the devices of mesh axis "fsdp" (ZeRO-3) on the real mesh.

Synchronous tables equal the layers applied sequentially; asynchronous ones
and every trainer equal the same schedule on unsharded stages; the compiled
step holds 1/F of the parameters, optimizer state and batch per device, and
gathers a stage's weights once per tick (or once per step)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.bench import hlo
from pipejax.errors import ConfigError
from tests.cases import fast_and_slow
from tests.reference import (assert_pipelines_exactly, batch, heterogeneous_layers, rel_err,
                             sequential_value_and_grad)

# Dropout-free: each device of a stage draws its own dropout keys for its
# part of a micro-batch, which the sequential model cannot reproduce.
LAYERS = [layer for layer in heterogeneous_layers() if not hasattr(layer, "rate")]
MB, M = 4, 4
T = pj.transforms


def _pipe(K, F, schedule="1f1b", R=1, **kw):
    return pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule=schedule,
                       mesh=pj.make_mesh(K, R, fsdp=F), **kw)


@functools.cache
def _sequential():
    return sequential_value_and_grad(LAYERS, M)


CASES = [(2, 2, "1f1b", None), (2, 2, "1f1b", "tick"), (4, 2, "1f1b", "tick"),
         (2, 4, "gpipe", "tick"), (2, 2, "zb-h1", "tick"), (2, 2, "interleaved", "tick"),
         (2, 2, "dualpipev", "tick"), (4, 2, "zb-v", "step"), (1, 4, "1f1b", None),
         (1, 2, "gpipe", "tick")]


@pytest.mark.parametrize("K, F, schedule, gather", fast_and_slow(CASES, fast=[CASES[0]]))
def test_a_sharded_stage_gives_the_sequential_loss_and_gradients(K, F, schedule, gather):
    pipe = _pipe(K, F, schedule, fsdp_gather=gather)
    params = pipe.init(jax.random.key(1))
    x, y = batch(M * MB)
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = _sequential()(pj.unstage(params), x, y, jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def _train(pipe, opt, steps=3, **kw):
    trainer = pipe.trainer(opt, **kw)
    state = trainer.init(pipe.init(jax.random.key(1)))
    losses = []
    for s in range(steps):
        state, m = trainer.step(state, batch(pipe.build.R * M * MB, seed=s))
        losses.append(np.asarray(m["losses"]))
    if pipe.schedule.asynchronous:
        state, m = trainer.flush(state)
        losses.append(np.asarray(m["losses"]))
    return np.concatenate(losses), state, trainer


ADAMW = optax.adamw(1e-2, weight_decay=0.1)
TRAINERS = {  # name: (schedule, optimizer, pipeline and trainer settings, data replicas)
    "pb-adamw": ("pb", ADAMW, {}, 1),
    # Adam scales a near-zero gradient's rounding up to an update: SGD to check the clip
    "1f1b-momentum-clip": ("1f1b", optax.sgd(0.05, momentum=0.9), {"clip_norm": 0.5}, 1),
    "pipedream-stash": ("pipedream", ADAMW, {"weight_stashing": True}, 1),
    "pb-spectrain": ("pb", lambda s: optax.chain(optax.sgd(0.05, momentum=0.9),
                                                 T.weight_forecast(horizon=s.delay)), {}, 1),
    "pb-ssgd-2-replicas": ("pb", ADAMW, {}, 2),
    # each op gathers its step's version, forward and backward apart
    "2bw-adamw": ("2bw", ADAMW, {}, 1),
    "2bw-ssgd-2-replicas-clip": ("2bw", ADAMW, {"clip_norm": 0.5}, 2),
    "gpipe-ssgd-2-replicas-step": ("gpipe", ADAMW, {"fsdp_gather": "step"}, 2),
}


@pytest.mark.parametrize("name", fast_and_slow(TRAINERS, fast=[]))
def test_a_sharded_trainer_equals_the_same_schedule_on_whole_stages(name):
    schedule, opt, settings, R = TRAINERS[name]
    split = {k: settings[k] for k in ("clip_norm",) if k in settings}
    kw = {k: v for k, v in settings.items() if k not in split}
    runs = [_train(_pipe(2, F, schedule, R, **kw), opt, **split) for F in (1, 2)]
    (whole_losses, whole, trainer), (losses, sharded, sharded_trainer) = runs
    done = np.isfinite(whole_losses)  # NaN: a micro-batch the call did not finish
    np.testing.assert_array_equal(np.isfinite(losses), done)
    assert rel_err(losses[done], whole_losses[done]) < 1e-5
    assert rel_err(pj.unstage(sharded), pj.unstage(whole)) < 1e-5
    # the optimizer state joined from the devices' pieces is the whole one
    assert rel_err(sharded_trainer.opt_state(sharded), trainer.opt_state(whole)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("settings, tolerance", [({"remat": "none"}, 1e-5),
                                                 ({"compute_dtype": jnp.bfloat16}, 2e-2)])
def test_remat_and_bf16_run_on_sharded_stages_as_on_whole_ones(settings, tolerance):
    """bf16: the tolerance of tests/compile/test_precision.py (8 significant
    bits; the halves of a micro-batch accumulate in another order)."""
    opt = optax.sgd(0.05, momentum=0.9)
    (a, whole, _), (b, sharded, _) = (_train(_pipe(2, F, **settings), opt) for F in (1, 2))
    assert rel_err(b, a) < tolerance / 10
    assert rel_err(pj.unstage(sharded), pj.unstage(whole)) < tolerance


def _gpt(K, F, schedule):
    layers = pj.models.gpt(depth=2, width=32, heads=2, context=16, vocab=64)
    x = jax.random.randint(jax.random.key(3), (M * MB, 16), 0, 64)
    y = jnp.roll(x, -1, axis=1)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MB], targets=y[:MB],
                       stages=K, microbatches=M, schedule=schedule, mesh=pj.make_mesh(K, fsdp=F))
    return layers, pipe, (x, y)


def test_the_zoo_gpt_on_4_stages_of_2_devices_equals_the_sequential_model():
    layers, pipe, tokens = _gpt(4, 2, "1f1b")
    assert_pipelines_exactly(pipe, layers, pipe.init(jax.random.key(0)), tokens,
                             pj.losses.next_token)


@pytest.mark.slow
def test_the_zoo_gpt_under_pb_with_adamw_on_sharded_stages_equals_whole_stages():
    # Adam's first update g / (|g| + eps) turns a gradient's rounding (the
    # halves of a micro-batch summed in another order: ~1e-9) into lr·Δg/eps:
    # 4e-5 of the weights at eps = 1e-8, 1e-6 at eps = 1e-3 (measured).
    runs = []
    for F in (1, 2):
        _, pipe, data = _gpt(4, F, "pb")
        trainer = pipe.trainer(optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))
        state, m = trainer.step(trainer.init(pipe.init(jax.random.key(0))), data)
        state, flushed = trainer.flush(state)
        runs.append((np.concatenate([m["losses"], flushed["losses"]]), pj.unstage(state)))
    done = np.isfinite(runs[0][0])
    assert rel_err(runs[1][0][done], runs[0][0][done]) < 1e-5
    assert rel_err(runs[1][1], runs[0][1]) < 1e-5


def _compiled(pipe, opt=optax.adam(1e-3)):
    trainer = pipe.trainer(opt)
    state = trainer.init(pipe.init(jax.random.key(1)))
    return trainer.step.lower(state, batch(M * MB)).compile()


@pytest.mark.slow  # a device's share of each leaf runs fast in tests/test_placed.py
def test_a_device_holds_a_quarter_of_the_arguments_at_fsdp_4():
    """Parameters, Adam's state and the batch, per device, of a heterogeneous stage list."""
    whole, sharded = (_compiled(_pipe(2, F)).memory_analysis() for F in (1, 4))
    ratio = sharded.argument_size_in_bytes / whole.argument_size_in_bytes
    assert ratio <= 0.30, ratio


@pytest.mark.parametrize("schedule, gather, forecast", fast_and_slow(
    [("1f1b", "step", False), ("pb", "tick", False), ("1f1b", "tick", False),
     ("pb", "tick", True)], fast=[("1f1b", "step", False), ("pb", "tick", False)]))
def test_the_step_gathers_each_slot_once_per_tick_or_once_per_step(schedule, gather, forecast):
    pipe = _pipe(2, 2, schedule, fsdp_gather=gather)
    opt = (lambda s: optax.chain(optax.sgd(0.05, momentum=0.9),
                                 T.weight_forecast(horizon=s.delay))) if forecast else ADAMW
    text = _compiled(pipe, opt).as_text()
    slots = len(pipe.layout.params.slots)
    gathers = hlo.per_tick(text, pipe.schedule.ticks, "all-gather")
    scatters = hlo.per_tick(text, pipe.schedule.ticks, "reduce-scatter")
    if gather == "step":
        assert gathers == {"tick": 0, "step": slots} and scatters == {"tick": 0, "step": slots}
    else:  # the forward's weights, and a forecasting stage's backward's apart (XLA may
        # merge a slot's two gathers where it proves them equal); a gradient scattered in
        # the loop of the op that made it: the backward's, or the last stage's fused pair's
        assert gathers["step"] == 0 and slots <= gathers["tick"] <= slots * (1 + forecast)
        assert scatters["step"] == 0 and slots <= scatters["tick"] <= 2 * slots


@pytest.mark.slow
def test_a_checkpoint_of_sharded_stages_restores_onto_whole_ones(tmp_path):
    a, b = _pipe(2, 2), _pipe(4, 1)
    ta, tb = a.trainer(ADAMW), b.trainer(ADAMW)
    state = ta.init(a.init(jax.random.key(1)))
    for s in range(2):
        state, _ = ta.step(state, batch(M * MB, seed=s))
    pj.save(tmp_path, ta, state)
    assert rel_err(ta.opt_state(pj.restore(tmp_path, ta)), ta.opt_state(state)) == 0
    state, m = ta.step(state, batch(M * MB, seed=2))
    for trainer in (ta, tb):
        _, got = trainer.step(pj.restore(tmp_path, trainer), batch(M * MB, seed=2))
        assert rel_err(got["loss"], m["loss"]) < 1e-5


def test_settings_a_sharded_stage_cannot_take_are_named():
    with pytest.raises(ConfigError, match=r"micro-batch of 4 examples does not split over the "
                                          r"mesh's fsdp=8 .* divisible by 8"):
        _pipe(1, 8)
    with pytest.raises(ConfigError, match=r"fsdp_gather='step' .* 'pb' updates them after every "
                                          "backward; use 'tick'"):
        _pipe(2, 2, "pb", fsdp_gather="step")
    with pytest.raises(ConfigError, match=r"fsdp_gather='once'; use 'tick'"):
        _pipe(2, 2, fsdp_gather="once")
    with pytest.raises(ConfigError, match=r"fsdp=0; use a positive integer"):
        pj.make_mesh(2, fsdp=0)
    with pytest.raises(ConfigError, match=r"rule 'adpsgd' names the mesh axis 'fsdp'"):
        _pipe(2, 2, R=2).trainer(ADAMW, rule=T.adpsgd("fsdp"))
    with pytest.raises(ConfigError, match=r"stage 0's optimizer keeps state not shaped like the "
                                          r"parameters .* fsdp=2 .* or fsdp=1"):
        _pipe(2, 2).trainer(optax.adafactor(1e-3, min_dim_size_to_factor=4))


def test_a_stateless_optimizer_on_sharded_stages_has_an_empty_state():
    pipe = _pipe(2, 2)
    trainer = pipe.trainer(optax.sgd(0.1))
    states = trainer.opt_state(trainer.init(pipe.init(jax.random.key(0))))
    assert len(states) == 2 and not jax.tree.leaves(states)


def test_the_joined_optimizer_state_keeps_its_own_dtype():
    """Adam's first moment in bfloat16 beside float32 weights: joined from
    the pieces as it is kept, not cast to the weights' dtype."""
    opt = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
    (_, whole, trainer), (_, sharded, sharded_trainer) = (
        _train(_pipe(2, F), opt, steps=1) for F in (1, 2))
    mu = lambda t, s: [a for state in t.opt_state(s) for a in jax.tree.leaves(state[0].mu)]
    assert {a.dtype for a in mu(sharded_trainer, sharded)} == {jnp.dtype(jnp.bfloat16)}
    assert rel_err(mu(sharded_trainer, sharded), mu(trainer, whole)) < 1e-2
