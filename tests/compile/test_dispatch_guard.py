"""The CPU dispatch guard: bounded calls in flight, `lower().compile()` included.

Without the guard, 400 back-to-back calls of a compiled 4-stage PB step hang
on XLA CPU (a run here: the watchdog fired after 60 s); with it they take
about half a second. The loop runs in a subprocess with a timeout, so that a
regression fails this test instead of hanging the suite.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import optax

import pipejax as pj
from pipejax.compile import guard

LOOP = textwrap.dedent("""
    import os  # the tests' compiler flags (conftest), on 4 devices
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    import jax, jax.numpy as jnp, optax
    import pipejax as pj
    pipe = pj.pipeline(pj.models.mlp(3, 16, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((2, 20)), stages=4, microbatches=2, schedule="pb")
    trainer = pipe.trainer(optax.sgd(0.01))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((4, 20)), jnp.zeros((4,), jnp.int32))
    compiled = trainer.step.lower(state, batch).compile()
    for _ in range(400):
        state, metrics = compiled(state, batch)
    print("steps", int(state.step), "completed", int(metrics["completed"]))
""")


def test_back_to_back_compiled_steps_do_not_deadlock():
    out = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "steps 400 completed 2" in out.stdout


def test_every_stage_of_a_jitted_function_stays_guarded():
    pipe = pj.pipeline(pj.models.mlp(2, 8, 10), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((2, 20)), stages=2, microbatches=2)
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)))
    batch = (jnp.zeros((4, 20)), jnp.zeros((4,), jnp.int32))
    lowered = trainer.step.lower(state, batch)
    assert isinstance(lowered, guard.Guarded) and isinstance(lowered.compile(), guard.Guarded)
    assert isinstance(trainer.step.trace(state, batch).lower(), guard.Guarded)
    for _ in range(5):
        state, _ = trainer.step(state, batch)
        assert guard.in_flight() <= guard.DEPTH
    # everything else is the jitted function's own
    assert lowered.as_text() == trainer.step._fn.lower(state, batch).as_text()
