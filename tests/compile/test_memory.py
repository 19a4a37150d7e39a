"""The memory predicted before compiling against XLA's figure for the compiled step."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.bench import peak_bytes
from pipejax.compile.memory import update_bytes
from tests.cases import fast_and_slow


@pytest.mark.parametrize("schedule,remat", fast_and_slow(
    [("gpipe", "stage"), ("1f1b", "none"), ("pb", "stage"), ("zb-v", "stage")],
    fast=[("1f1b", "none"), ("pb", "stage"), ("zb-v", "stage")]))
def test_prediction_is_within_a_quarter_of_the_compiled_step(schedule, remat):
    M, mb = 4, 8
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, 40)), stages=4, microbatches=M, schedule=schedule,
                       remat=remat)
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((M * mb, 40)), jnp.zeros((M * mb,), jnp.int32))
    compiled = peak_bytes(trainer.step.lower(state, batch).compile())
    predicted = trainer.memory()
    assert abs(predicted.total / compiled - 1) < 0.25
    assert "optimizer state" in str(predicted)
    own = [sum(stage.values()) for stage in predicted.stages]
    assert max(own) <= predicted.total and own[predicted.heaviest] == max(own)


def test_step_donates_its_state_and_says_so_when_it_is_reused():
    """The step writes the new state into the old one's buffers (XLA aliases
    every parameter and optimizer-state buffer); passing the old state again
    is a clear error, not a crash of the process."""
    M, mb = 4, 8
    pipe = pj.pipeline(pj.models.mlp(depth=4, width=64), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, 40)), stages=4, microbatches=M)
    trainer = pipe.trainer(optax.adam(1e-3))
    old = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((M * mb, 40)), jnp.zeros((M * mb,), jnp.int32))
    analysis = trainer.step.lower(old, batch).compile().memory_analysis()
    # memory_analysis() counts one device: a K-th of the stage-sharded buffers.
    held = sum(b.nbytes for b in (*old.params.buffers, *old.opt_state.buffers)) // 4
    assert analysis.alias_size_in_bytes >= held
    kept = jax.tree.map(jnp.copy, old)
    new, _ = trainer.step(old, batch)
    assert old.params.buffers[0].is_deleted() and not kept.params.buffers[0].is_deleted()
    with pytest.raises(pj.errors.ArgumentTypeError, match="donated to an earlier call"):
        trainer.step(old, batch)
    trainer.step(kept, batch)  # a copy made before is a state of its own


@pytest.mark.slow  # every table and remat mode: benchmarks/planner.py --part memory
def test_a_recomputed_transformer_stage_is_predicted_within_three_percent():
    # The working set is the backward's own buffers as XLA compiles it: the
    # residuals its vjp names without remat over-count a recomputed block
    # (+18 % on this step). Beside it the tick's messages (−4.3 % without).
    M, mb = 4, 8
    tokens = jnp.zeros((mb, 32), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=2, width=64, heads=4, context=32),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=2,
                       microbatches=M, schedule="1f1b", remat="stage")
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((M * mb, 32), jnp.int32),) * 2
    compiled = peak_bytes(trainer.step.lower(state, batch).compile())
    assert abs(trainer.memory().total / compiled - 1) < 0.03, (trainer.memory().total, compiled)


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("pipedream", marks=pytest.mark.slow)])
def test_a_step_whose_weights_outweigh_its_activations_is_predicted_within_two_percent(schedule):
    """The update holds copies of the flat slots' state and weights (the
    first stage's 40x256 kernel pads its slot), none where every slot keeps
    its leaves' shape: after the scan where the backward's working set was
    (1F1B), or beside it in the backward's op (PipeDream). Counting a copy
    of the weights beside the working set instead over-predicted the 1F1B
    step by 10 %, the update's result beside what it reads PipeDream's by 9 %."""
    M, mb = 8, 8
    pipe = pj.pipeline(pj.models.mlp(depth=8, width=256), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, 40)), stages=4, microbatches=M, schedule=schedule)
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((M * mb, 40)), jnp.zeros((M * mb,), jnp.int32))
    compiled = peak_bytes(trainer.step.lower(state, batch).compile())
    assert abs(trainer.memory().total / compiled - 1) < 0.02, (trainer.memory().total, compiled)
    opts = trainer._programs.optimizers
    slots = opts.params.slots
    # The first stage's 40x256 kernel pads a flat slot that other stages' 256x256 kernels fill.
    assert any(slots[s.slot][1] == (256 * 256,) and s.size < 256 * 256
               for s in opts.params.leaves[0])
    assert update_bytes(opts, 0) >= 3 * 4 * 256 * 256  # mu, nu and the new weights, float32
    alike = pj.pipeline(pj.models.mlp(depth=8, width=256), loss=pj.losses.cross_entropy,
                        example=jnp.zeros((mb, 40)), stages=1, microbatches=M)
    assert update_bytes(alike.trainer(optax.adam(1e-3))._programs.optimizers, 0) < 2**10


@pytest.mark.slow  # the replicas' rows of benchmarks/planner.py --part memory
def test_an_update_around_the_switch_is_predicted_with_the_gradient_it_waits_for():
    """PB on one stage and 2 data replicas runs SSGD's mean around the stage
    switch: the backward's gradient leaves the switch and is held beside the
    working set that makes it (without it, 2.7 % under on this GPT)."""
    tokens = jnp.zeros((8, 64), jnp.int32)
    pipe = pj.pipeline(pj.models.gpt(depth=2, width=32, heads=2, context=64),
                       loss=pj.losses.next_token, example=tokens, targets=tokens, stages=1,
                       microbatches=1, schedule="pb", remat="stage",
                       mesh=pj.mesh.make_mesh(1, data=2))
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    compiled = peak_bytes(trainer.step.lower(state, (jnp.zeros((16, 64), jnp.int32),) * 2)
                          .compile())
    predicted = trainer.memory()
    assert "working set and gradient, or update copy" in predicted.device
    assert abs(predicted.total / compiled - 1) < 0.01
