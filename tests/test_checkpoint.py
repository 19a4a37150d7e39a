"""Layout-free checkpoints: resume exactly, restore into other stages, atomic saves."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.cases import fast_and_slow

M, MB = 4, 2
LAYERS = pj.models.mlp(depth=3, width=16, classes=10)


def _trainer(K, schedule="gpipe", layers=LAYERS):
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                       stages=K, microbatches=M, schedule=schedule)
    return pipe, pipe.trainer(optax.adam(1e-2))


def _batch(i):
    return jax.random.normal(jax.random.key(i), (M * MB, 40)), jnp.arange(M * MB) % 10


def _flat(state):
    return np.concatenate([np.ravel(np.asarray(a)) for a in jax.tree.leaves(pj.unstage(state))])


# A synchronous restore: test_four_stage_checkpoint_restores_into_two_stages.
@pytest.mark.parametrize("schedule", fast_and_slow(["gpipe", "pb", "2bw"], fast=["pb", "2bw"]))
def test_ten_saved_and_ten_restored_steps_equal_twenty(tmp_path, schedule):
    pipe, trainer = _trainer(4, schedule)
    start = trainer.init(pipe.init(jax.random.key(0)))
    straight, losses = jax.tree.map(jnp.copy, start), []  # a step donates its state
    for i in range(20):
        straight, m = trainer.step(straight, _batch(i))
        losses.append(float(m["loss"]))
    state = start
    for i in range(10):
        state, _ = trainer.step(state, _batch(i))
    pj.save(tmp_path, trainer, state)  # PB, 2BW: what is in flight is saved too
    state = pj.restore(tmp_path, trainer)
    resumed = []
    for i in range(10, 20):
        state, m = trainer.step(state, _batch(i))
        resumed.append(float(m["loss"]))
    np.testing.assert_allclose(resumed, losses[10:], rtol=1e-6)
    np.testing.assert_allclose(_flat(state), _flat(straight), rtol=1e-6, atol=1e-7)
    assert int(state.step) == 20


@pytest.mark.slow  # stage 4 into stage 2 runs fast from data replicas into fsdp
def test_four_stage_checkpoint_restores_into_two_stages(tmp_path):
    pipe4, four = _trainer(4)
    state = four.init(pipe4.init(jax.random.key(0)))
    for i in range(3):
        state, _ = four.step(state, _batch(i))
    pj.save(tmp_path, four, state)
    _, two = _trainer(2)
    again = pj.restore(tmp_path, two)
    np.testing.assert_array_equal(_flat(again), _flat(state))
    state, m4 = four.step(state, _batch(3))
    again, m2 = two.step(again, _batch(3))  # Adam's moments and count came along
    np.testing.assert_allclose(float(m2["loss"]), float(m4["loss"]), rtol=1e-6)
    np.testing.assert_allclose(_flat(again), _flat(state), rtol=1e-6, atol=1e-7)


def test_a_v_placement_checkpoint_restores_into_a_loop(tmp_path):
    # Device 0 holds the first and last chunks under zb-v, the first and third under interleaved.
    pipe_v, on_v = _trainer(2, "zb-v")
    state = on_v.init(pipe_v.init(jax.random.key(0)))
    state, _ = on_v.step(state, _batch(0))
    pj.save(tmp_path, on_v, state)
    pipe_loop = pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                            stages=2, microbatches=M, schedule="interleaved", virtual=2)
    loop = pipe_loop.trainer(optax.adam(1e-2))
    again = pj.restore(tmp_path, loop)
    np.testing.assert_array_equal(_flat(again), _flat(state))
    state, m_v = on_v.step(state, _batch(1))
    again, m_loop = loop.step(again, _batch(1))
    np.testing.assert_allclose(float(m_loop["loss"]), float(m_v["loss"]), rtol=1e-6)
    np.testing.assert_allclose(_flat(again), _flat(state), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # restores across K and from asynchronous run fast apart
def test_asynchronous_checkpoint_restores_into_other_stages_after_a_flush(tmp_path):
    pipe, four = _trainer(4, "pb")
    state = four.init(pipe.init(jax.random.key(0)))
    for i in range(3):
        state, _ = four.step(state, _batch(i))
    pj.save(tmp_path / "inflight", four, state)
    _, two = _trainer(2, "pb")
    with pytest.raises(pj.errors.CheckpointError, match="flush the trainer before saving"):
        pj.restore(tmp_path / "inflight", two)
    state, _ = four.flush(state)
    pj.save(tmp_path / "flushed", four, state)
    again = pj.restore(tmp_path / "flushed", two)
    np.testing.assert_array_equal(_flat(again), _flat(state))
    again, m = two.step(again, _batch(3))
    assert np.isfinite(float(m["loss"])) and int(m["microbatch"][0]) >= 3 * M


def test_a_flushed_2bw_checkpoint_restores_into_other_stages_and_a_synchronous_trainer(
        tmp_path):
    """After a flush a 2BW pipeline starts anew, W(−1) = W(0): its next step
    is the step of a 2BW trainer at another K restored from it, and of a
    synchronous one (the gradient at the weights it updates)."""
    pipe, four = _trainer(4, "2bw")
    state = four.init(pipe.init(jax.random.key(0)))
    for i in range(3):
        state, _ = four.step(state, _batch(i))
    state, _ = four.flush(state)
    pj.save(tmp_path, four, state)
    state, _ = four.step(state, _batch(3))
    state, _ = four.flush(state)
    for K, schedule in ((2, "2bw"), (2, "1f1b")):
        _, other = _trainer(K, schedule)
        again, _ = other.step(pj.restore(tmp_path, other), _batch(3))
        if schedule == "2bw":
            again, _ = other.flush(again)
        np.testing.assert_allclose(_flat(again), _flat(state), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a restore between synchronous and asynchronous trainers runs fast (2bw)
def test_a_synchronous_checkpoint_restores_into_an_asynchronous_trainer(tmp_path):
    """Nothing is in flight between a synchronous table's steps: the
    asynchronous trainer starts an empty pipeline, as its own init does,
    from the saved weights, optimizer state and step."""
    pipe, four = _trainer(4)
    state = four.init(pipe.init(jax.random.key(0)))
    for i in range(3):
        state, _ = four.step(state, _batch(i))
    pj.save(tmp_path, four, state)
    for K in (4, 2):  # the saved layout, and another
        pipe_pb, pb = _trainer(K, "pb")
        again = pj.restore(tmp_path, pb)
        np.testing.assert_array_equal(_flat(again), _flat(state))
        fresh = pb.init(pipe_pb.init(jax.random.key(0)))
        for a, b in zip(jax.tree.leaves(again.inflight), jax.tree.leaves(fresh.inflight)):
            np.testing.assert_array_equal(a, b)
        assert int(again.step) == 3
        again, m = pb.step(again, _batch(3))
        assert np.isfinite(float(m["loss"]))


def test_incompatible_trainer_names_the_first_mismatching_layer(tmp_path):
    pipe, trainer = _trainer(2)
    pj.save(tmp_path, trainer, trainer.init(pipe.init(jax.random.key(0))))
    _, wider = _trainer(2, layers=pj.models.mlp(depth=3, width=32, classes=10))
    with pytest.raises(pj.errors.CheckpointError,
                       match=r"layer 0 differs: the checkpoint has Dense with params.bias "
                             r"float32\[16\].*this pipeline has Dense with params.bias "
                             r"float32\[32\]"):
        pj.restore(tmp_path, wider)
    _, deeper = _trainer(2, layers=pj.models.mlp(depth=4, width=16, classes=10))
    with pytest.raises(pj.errors.CheckpointError, match="layer 6 differs"):
        pj.restore(tmp_path, deeper)
    with pytest.raises(pj.errors.CheckpointError, match="no checkpoint"):
        pj.restore(tmp_path / "empty", trainer)
    momentum = pipe.trainer(optax.sgd(0.1, momentum=0.9))
    with pytest.raises(pj.errors.CheckpointError,
                       match=r"saved by an optimizer whose state is \(ScaleByAdamState, "
                             r"EmptyState\), this trainer's is \(TraceState, EmptyState\)"):
        pj.restore(tmp_path, momentum)


def test_replicas_and_a_decentralized_rule_state_resume_exactly(tmp_path):
    pipe = pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                       stages=2, microbatches=2, mesh=pj.make_mesh(2, 2))
    trainer = pipe.trainer(optax.sgd(0.1, momentum=0.9), pj.transforms.adpsgd())
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = _batch(0)
    for _ in range(3):
        state, _ = trainer.step(state, batch)
    pj.save(tmp_path, trainer, state)
    again = pj.restore(tmp_path, trainer)  # replicas differ: gossip's state came along
    (state, m1), (again, m2) = trainer.step(state, batch), trainer.step(again, batch)
    assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(state.params.buffers, again.params.buffers):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _on(K, R=1, F=1, mb=MB, opt=optax.adam(1e-2), rule=None):
    pipe = pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((mb, 40)),
                       stages=K, microbatches=M, mesh=pj.make_mesh(K, R, fsdp=F))
    return pipe, pipe.trainer(opt, rule)


def _both(i):
    """A batch of two replicas' micro-batches (2·M·MB examples)."""
    return tuple(jnp.concatenate(parts) for parts in zip(_batch(i), _batch(i + 100)))


@pytest.mark.parametrize("F", fast_and_slow([2, 1], fast=[2]))
def test_a_checkpoint_of_two_replicas_restores_into_one_and_into_shards(tmp_path, F):
    """Saved at (stage 4, data 2) under SSGD, restored at (stage 2, data 1,
    fsdp F): the weights as saved, and the next step on the same examples
    (the mean loss over all of them) the unbroken run's."""
    pipe, trainer = _on(4, R=2)
    state = trainer.init(pipe.init(jax.random.key(0)))
    for i in range(2):
        state, _ = trainer.step(state, _both(i))
    pj.save(tmp_path, trainer, state)
    _, want = trainer.step(state, _both(2))
    _, other = _on(2, F=F, mb=2 * MB)
    restored = pj.restore(tmp_path, other)
    np.testing.assert_array_equal(_flat(restored), _flat(pj.restore(tmp_path, trainer)))
    _, got = other.step(restored, _both(2))
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-5 * abs(float(want["loss"]))


def test_differing_replicas_restore_into_one_as_their_mean(tmp_path):
    pipe, trainer = _on(2, R=2, opt=optax.sgd(0.1), rule=pj.transforms.adpsgd())
    state = trainer.init(pipe.init(jax.random.key(0)))
    for i in range(3):
        state, _ = trainer.step(state, _both(i))
    pj.save(tmp_path, trainer, state)
    replica = lambda r: np.concatenate([np.ravel(a) for a in jax.tree.leaves(pj.unstage(state, r))])
    assert np.abs(replica(0) - replica(1)).max() > 1e-4  # gossip: the replicas differ
    _, one = _on(2, opt=optax.sgd(0.1))
    np.testing.assert_allclose(_flat(pj.restore(tmp_path, one)), _flat(state), rtol=1e-6)


SAVER = """
import os, sys
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, optax
import pipejax as pj
layers = pj.models.mlp(depth=4, width=512, classes=10)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((2, 40)), stages=4,
                   microbatches=2)
trainer = pipe.trainer(optax.adam(1e-3))
state = trainer.init(pipe.init(jax.random.key(0)))
pj.save(sys.argv[1], trainer, state)
print("saved", flush=True)
for step in range(1, 1000):
    state = state._replace(step=state.step + 1)
    pj.save(sys.argv[1], trainer, state)
"""


def test_a_save_killed_midway_leaves_the_last_checkpoint_loadable(tmp_path):
    """SIGKILL while orbax writes a later checkpoint (its temporary directory
    exists): the last complete one is still the latest, and loads."""
    path = tmp_path / "ckpt"
    # the test's XLA options but its own device count: both processes compute
    # the same initial values (LLVM's optimization level changes their last bit)
    flags = [f for f in os.environ["XLA_FLAGS"].split() if "device_count" not in f]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags)}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not any("tmp" in p.name for p in path.iterdir()):  # a save under way
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any("tmp" in p.name for p in path.iterdir())  # killed midway
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=512, classes=10),
                       loss=pj.losses.cross_entropy, example=jnp.zeros((2, 40)), stages=4,
                       microbatches=2)
    trainer = pipe.trainer(optax.adam(1e-3))
    step = pj.checkpoint.latest(path)
    state = pj.restore(path, trainer)
    assert int(state.step) == step
    np.testing.assert_array_equal(_flat(state), _flat(trainer.init(pipe.init(jax.random.key(0)))))
