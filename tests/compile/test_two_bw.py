"""PipeDream-2BW (the '2bw' family) against an independent reference:
W(t + 1) = W(t) + u(∇f(W(t − 1))), W(−1) = W(0), at every stage, u the
optimizer's update (with error feedback too: a stage's chain keeps its
previous update across steps)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.bench import peak_bytes
from pipejax.errors import ConfigError, ScheduleError
from tests.cases import fast_and_slow
from tests.reference import batch, heterogeneous_layers, rel_err

MB = 2  # examples a micro-batch
KEY = jax.random.key(9)  # the trainer's key: micro-batch i's dropout draws fold_in(KEY, i)


def reference(layers, variables, opt, batches, M, ids, flush_after=(), MB=MB, ranges=None):
    """2BW written as a loop over steps on the whole model: step t's gradient
    is that of its mean micro-batch loss at W(t − 1), applied to W(t); after
    a flush the pipeline starts anew (W(−1) = W(0) again). `ids`: each
    micro-batch's id, whose key its dropout draws from (a flush skips ids);
    `ranges`: the stages' layers, each updated by its own `opt` (a clip by
    the norm of its own gradient), else one `opt` on the whole model.
    Returns the last weights and each micro-batch's loss."""
    if ranges is not None:
        opt = optax.multi_transform({str(k): opt for k in range(len(ranges))},
                                    [str(k) for k, r in enumerate(ranges) for _ in r])

    def mean_loss(w, x, y, ids):
        def one(m):
            key = jax.random.fold_in(KEY, ids[m])
            out = pj.apply_layers(layers, w, x[m * MB:(m + 1) * MB], key)
            return pj.losses.cross_entropy(out, y[m * MB:(m + 1) * MB])
        losses = jnp.stack([one(m) for m in range(M)])
        return losses.mean(), losses

    grad = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))
    previous, current, state, losses = variables, variables, opt.init(variables), []
    for t, (x, y) in enumerate(batches):
        (_, each), g = grad(previous, x, y, jnp.asarray(ids[t * M:(t + 1) * M]))
        updates, state = opt.update(g, state, current)
        previous, current = current, optax.apply_updates(current, updates)
        losses += list(np.asarray(each))
        if t in flush_after:
            previous = current
    return current, np.asarray(losses)


def run(K, M, opt, steps, remat="stage", flush_after=(), R=1, clip=None):
    """`steps` steps of '2bw' (a flush after each step in `flush_after`, and at
    the end), on R data replicas (SSGD; then an MLP: no dropout), the trainer's
    `clip_norm`; the last weights and each micro-batch's loss, with the
    reference's (on R replicas the micro-batch m of all of them as one)."""
    layers = heterogeneous_layers() if R == 1 else pj.models.mlp(3, 16, 10)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule="2bw", remat=remat,
                       mesh=pj.make_mesh(K, R))
    params = pipe.init(jax.random.key(1))
    trainer = pipe.trainer(opt, clip_norm=clip)
    state = trainer.init(params, KEY)
    batches, losses = [batch(R * M * MB, seed=s) for s in range(steps)], {}

    def record(metrics):
        for g, loss in zip(np.asarray(metrics["microbatch"]), np.asarray(metrics["losses"])):
            if not np.isnan(loss):
                losses[int(g)] = float(loss)

    for t, b in enumerate(batches):
        state, metrics = trainer.step(state, b)
        record(metrics)
        if t in flush_after:
            state, metrics = trainer.flush(state)
            record(metrics)
    state, metrics = trainer.flush(state)
    record(metrics)
    ids = sorted(losses)
    assert len(ids) == steps * M  # every micro-batch came out once
    assert ids == list(range(steps * M)) or flush_after  # a flush skips the ids of its periods
    ref_opt = opt if clip is None else optax.chain(optax.clip_by_global_norm(clip), opt)
    ref, ref_losses = reference(layers, pj.unstage(params), ref_opt, batches, M, ids,
                                flush_after, R * MB, None if clip is None else pipe.plan.ranges)
    return pipe, pj.unstage(state.params), np.array([losses[g] for g in ids]), ref, ref_losses


OPTIMIZERS = {"sgd": optax.sgd(0.05, momentum=0.9), "adamw": optax.adamw(3e-3, weight_decay=0.1),
              "adamw+ef": optax.chain(optax.adamw(3e-3, weight_decay=0.1),
                                      pj.transforms.error_feedback())}


@pytest.mark.parametrize("K,M,opt", fast_and_slow(
    [(K, M, o) for K, M in ((1, 2), (2, 2), (4, 4)) for o in OPTIMIZERS],
    fast=[(4, 4, "sgd")]))
def test_2bw_equals_the_one_step_delayed_reference(K, M, opt):
    pipe, params, losses, ref, ref_losses = run(K, M, OPTIMIZERS[opt], steps=5)
    assert pipe.schedule.delays == [1] * K
    assert rel_err(params, ref) < 1e-5
    assert rel_err(losses, ref_losses) < 1e-5


@pytest.mark.slow  # the fast equality cases run K = 2 and 4 without a flush
def test_2bw_after_a_flush_and_with_kept_residuals():
    """A flush applies every step in flight and the pipeline starts anew;
    remat "none" is exact (the residuals were made at the backward's version)."""
    _, params, losses, ref, ref_losses = run(4, 3, OPTIMIZERS["adamw"], steps=5, remat="none",
                                             flush_after=(1,))
    assert rel_err(params, ref) < 1e-5
    assert rel_err(losses, ref_losses) < 1e-5


@pytest.mark.slow  # the update after the loop, masked at every tick: its own compile
def test_2bw_on_data_replicas_with_a_clip():
    """The update runs after the loop on every device (the replicas' mean and
    the clip are collectives), masked where no step ends; the clip's norm is
    over the stages that update at a tick: here each stage's own."""
    _, params, losses, ref, ref_losses = run(2, 2, OPTIMIZERS["adamw"], steps=4, R=2, clip=0.5)
    assert rel_err(params, ref) < 1e-5
    step_mean = lambda a: a.reshape(-1, 2).mean(axis=1)
    assert rel_err(step_mean(losses), step_mean(ref_losses)) < 1e-5


@pytest.mark.slow  # a GPT split over tensor devices: its own compiles
def test_2bw_split_over_tensor_devices_equals_one_device_a_stage():
    layers = pj.models.gpt(2, 32, 2, 16, 64)
    x = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
    y = jnp.roll(x, -1, 1)
    out = {}
    for T in (1, 2):
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:2], targets=y[:2],
                           stages=2, microbatches=4, schedule="2bw", remat="none",
                           mesh=pj.make_mesh(2, tensor=T))
        trainer = pipe.trainer(optax.sgd(0.1, momentum=0.9))
        state = trainer.init(pipe.init(jax.random.key(1)))
        for _ in range(3):
            state, _ = trainer.step(state, (x, y))
        out[T] = pj.unstage(trainer.flush(state)[0].params)
    assert rel_err(out[2], out[1]) < 1e-5  # 2.7e-7 measured


def test_simulate_runs_the_2bw_trainer_a_step_an_update():
    """`pj.simulate(delays="2bw")`: delay 1 at every stage, the backward on
    the forward's version, each step's batch one update."""
    K, M, steps, opt = 4, 3, 5, OPTIMIZERS["adamw"]
    layers = pj.models.mlp(3, 16, 10)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, schedule="2bw")
    params = pipe.init(jax.random.key(1))
    trainer = pipe.trainer(opt)
    state = trainer.init(params, KEY)
    batches = [batch(M * MB, seed=s) for s in range(steps)]
    for b in batches:
        state, _ = trainer.step(state, b)
    state, _ = trainer.flush(state)
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=opt,
                      split=pipe.plan.split, delays="2bw")
    assert sim.delays == [1] * K
    xs, ys = (jnp.stack(a) for a in zip(*batches))
    done, _ = sim.run(sim.init(pj.unstage(params), KEY), xs, ys)
    assert rel_err(sim.params(done), pj.unstage(state.params)) < 1e-5


def test_2bw_holds_two_weight_versions_not_one_per_micro_batch():
    """And its memory is predicted: 2.2 % under the compiled step measured."""
    M, mb = 4, 8
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, 40)), stages=4, microbatches=M, schedule="2bw",
                       remat="none")
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((M * mb, 40)), jnp.zeros((M * mb,), jnp.int32))
    compiled = peak_bytes(trainer.step.lower(state, batch).compile())
    assert abs(trainer.memory().total / compiled - 1) < 0.05
    layout = pipe.layout
    assert layout.versions and not layout.weight_stashing and layout.weight_stash_bytes == 0
    assert layout.versions_bytes == 2 * layout.pieces.slot_bytes()  # W(v − 1) and the gradient
    assert "previous weights" in str(layout)
    info = pipe.schedule.stage_info(0)
    assert (info.delay, info.forward_horizon, info.backward_horizon) == (1, 0, 0)


def test_2bw_state_holds_one_previous_version_whatever_K():
    """The trainer's state, counted: beside the live weights, 2BW keeps one
    previous version and one gradient sum a stage, at K = 2 and 4 alike,
    where PipeDream's weight stashing keeps a version per micro-batch in
    flight, which grows with K."""
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    for K in (2, 4):
        held = {}
        for schedule, stash in (("2bw", False), ("pipedream", True)):
            pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                               example=jnp.zeros((8, 40)), stages=K, microbatches=4,
                               schedule=schedule, weight_stashing=stash)
            state = pipe.trainer(optax.sgd(0.1)).init(pipe.init(jax.random.key(0)))
            held[schedule] = state.inflight.rings, nbytes(state.params)
        rings, weights = held["2bw"]
        assert nbytes(rings.weights) == 0
        assert nbytes(rings.versions.previous) == nbytes(rings.versions.accumulated) == weights
        stashed, weights = held["pipedream"]
        assert nbytes(stashed.weights) == K * weights and nbytes(stashed.versions) == 0


def test_2bw_misuse_is_a_clear_error():
    layers, args = heterogeneous_layers(), {"loss": pj.losses.cross_entropy,
                                            "example": jnp.zeros((MB, 20))}
    with pytest.raises(ConfigError, match="a step needs M >= 3 micro-batches"):
        pj.pipeline(layers, stages=4, microbatches=2, schedule="2bw", **args)
    with pytest.raises(ConfigError, match="drop weight_stashing"):
        pj.pipeline(layers, stages=2, microbatches=2, schedule="2bw", weight_stashing=True,
                    **args)
    # a table two versions cannot run: PipeDream's ticks at too few micro-batches
    with pytest.raises(ScheduleError, match="before step 0's update"):
        dataclasses.replace(pj.schedules.pipedream(4, 2), double_buffered=True)
    with pytest.raises(ScheduleError, match="needs an asynchronous table"):
        dataclasses.replace(pj.schedules.one_f_one_b(2, 2), double_buffered=True)
