"""The memory predicted before compiling against XLA's figure for the compiled step."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.bench import peak_bytes


@pytest.mark.parametrize("schedule,remat", [("gpipe", "stage"), ("1f1b", "none"), ("pb", "stage")])
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
    assert "optimizer state (in + out)" in str(predicted)
    own = [sum(stage.values()) for stage in predicted.stages]
    assert max(own) <= predicted.total and own[predicted.heaviest] == max(own)
