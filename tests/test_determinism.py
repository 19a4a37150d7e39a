"""The same seed gives the same run; a synchronous run does not depend on K."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj

M, MB = 4, 2
LAYERS = pj.models.mlp(depth=3, width=16, classes=10, dropout=0.2)


def _run(K, schedule="gpipe", steps=3):
    pipe = pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                       stages=K, microbatches=M, schedule=schedule)
    trainer = pipe.trainer(optax.adam(1e-2))
    state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
    losses = []
    for i in range(steps):
        x = jax.random.normal(jax.random.key(10 + i), (M * MB, 40))
        state, m = trainer.step(state, (x, jnp.arange(M * MB) % 10))
        losses.append(np.asarray(m["losses"]))
    return np.concatenate(losses), [np.asarray(a) for a in jax.tree.leaves(pj.unstage(state))]


def test_same_seed_same_metrics_and_parameters():
    (la, pa), (lb, pb) = _run(2, "pb"), _run(2, "pb")
    np.testing.assert_array_equal(la, lb)
    for a, b in zip(pa, pb):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # the same seed twice runs fast
def test_synchronous_run_is_the_same_twice_and_on_any_number_of_stages():
    """Dropout keys follow the layer's global index and the micro-batch, so
    1 and 4 stages train the same model (up to float reassociation)."""
    (ref_losses, ref), (losses, params), (again, params_again) = _run(1), _run(4), _run(4)
    np.testing.assert_array_equal(losses, again)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b, c in zip(params, ref, params_again):
        np.testing.assert_array_equal(a, c)
        assert np.max(np.abs(a - b)) <= 1e-6 * max(1.0, np.max(np.abs(b)))


def test_a_model_that_draws_nothing_makes_no_micro_batch_keys():
    """Each op's loop ties its operands to its trip count, so XLA cannot drop
    an unused key: the ops make a micro-batch's key only where a layer draws
    from it (the step's own key, folded with its count, is made either way)."""
    def fold_ins(layers) -> int:
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                           stages=2, microbatches=M, schedule="zb-h1")
        trainer = pipe.trainer(optax.sgd(0.1))
        state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
        batch = (jnp.zeros((M * MB, 40)), jnp.zeros((M * MB,), jnp.int32))
        return str(trainer.step.trace(state, batch).jaxpr).count("random_fold_in")

    assert fold_ins(pj.models.mlp(depth=3, width=16, classes=10)) == 1
    assert fold_ins(LAYERS) > 1  # with dropout, every op's micro-batch key
