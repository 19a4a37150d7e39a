"""A collective that XLA's partitioner puts inside a stage's branch, joining
devices of stages that never run it, is a ConfigError before the first
step, never a 40-second hang and an abort; the rule reads the compiled HLO."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax.compile import rendezvous
from tests import llama
from tests.reference import assert_pipelines_exactly

M, MB, CONTEXT, VOCAB = 4, 4, 8, 64


def _pipe(layers, tensor, schedule="1f1b"):
    x = jax.random.randint(jax.random.key(0), (M * MB, CONTEXT), 0, VOCAB)
    y = jnp.roll(x, -1, axis=1)
    return pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MB], targets=y[:MB],
                       stages=2, microbatches=M, schedule=schedule,
                       mesh=pj.make_mesh(2, tensor=tensor)), (x, y)


# Two heads of 16 split over tensor = 4: a device holds half a head, and the
# rotary embedding swaps the halves across devices inside stage 0's backward.
UNEVEN = """
import jax, optax
from pipejax.errors import ConfigError
from tests import llama
from tests.compile.test_rendezvous import _pipe
pipe, batch = _pipe(llama.decoder(width=32, heads=2), tensor=4, schedule="{}")
trainer = pipe.trainer(optax.adamw(1e-3))
try:
    trainer.step(trainer.init(pipe.init(jax.random.key(0))), batch)
except ConfigError as e:
    print("ConfigError:", e)
"""


def test_a_collective_in_a_stage_branch_is_a_config_error_not_an_abort():
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # conftest's XLA flags: 8 devices, fast compiles
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", UNEVEN.format("gpipe")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    message = done.stdout
    assert "ConfigError: trainer.step" in message
    assert "collective-permute" in message and "stages 0 and 1" in message
    assert "llama.py" in message and "in rotary" in message
    assert "divides the number of heads" in message


@pytest.mark.slow
def test_the_same_decoder_at_a_tensor_degree_that_divides_the_heads_equals_the_sequential():
    layers = llama.decoder(width=32, heads=2)
    pipe, batch = _pipe(layers, tensor=2)
    assert_pipelines_exactly(pipe, layers, pipe.init(jax.random.key(0)), batch,
                             pj.losses.next_token)


def _expected(groups):
    return [sorted(g) for g in groups]


def test_the_groups_of_each_hlo_spelling_are_read():
    read = lambda text: _expected(rendezvous._groups(text, 8))
    assert read("x = f32[4] all-reduce(a), replica_groups=[4,2]<=[8], use") == \
        _expected(np.arange(8).reshape(4, 2))
    assert read("x = f32[4] all-reduce(a), replica_groups=[2,4]<=[4,2]T(1,0), use") == \
        _expected(np.arange(8).reshape(4, 2).T)
    assert read("x = f32[4] all-gather(a), replica_groups={{0,4},{1,5}}, dim") == [[0, 4], [1, 5]]
    assert read("x = f32[4] collective-permute(a), source_target_pairs={{0,1},{5,4}}, m") == \
        [[0, 1, 4, 5]]
    assert read("x = f32[4] all-reduce(a), replica_groups={}, to_apply=%add") == [list(range(8))]
