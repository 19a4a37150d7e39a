"""Generation and evaluation of a language model outside the pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj

CONTEXT = 8


@pytest.fixture(scope="module")
def model():
    layers = pj.models.gpt(depth=1, width=16, heads=2, context=CONTEXT)
    h, variables = jnp.zeros((1, CONTEXT), jnp.int32), []
    for i, layer in enumerate(layers):
        variables.append(layer.init(jax.random.key(i), h))
        h = layer.apply(variables[-1], h)
    return layers, variables


def test_greedy_generation_is_the_model_run_token_by_token(model):
    """Past the context too: each token is the argmax of the last position's
    logits over the last CONTEXT tokens."""
    layers, variables = model
    prompt = [5, 9, 200, 7, 7, 31]
    out = pj.generate(layers, variables, prompt, 5, context=CONTEXT, key=jax.random.key(0),
                      temperature=0)
    run = jax.jit(lambda v, t: pj.apply_layers(layers, v, t[None], train=False)[0, -1])
    tokens = list(prompt)
    for _ in range(5):
        tokens.append(int(jnp.argmax(run(variables, jnp.asarray(tokens[-CONTEXT:])))))
    assert out.tolist() == tokens[6:]


def test_sampling_is_fixed_by_the_key_and_top_k_limits_it(model):
    layers, variables = model
    draw = lambda seed, **kw: pj.generate(layers, variables, [1, 2], 30, context=CONTEXT,
                                          key=jax.random.key(seed), **kw)
    assert (draw(0) == draw(0)).all() and (draw(0) != draw(1)).any()
    one = draw(3, top_k=1)
    greedy = pj.generate(layers, variables, [1, 2], 30, context=CONTEXT, key=jax.random.key(0),
                         temperature=0)
    assert (one == greedy).all()
    with pytest.raises(pj.errors.ConfigError, match="at least one prompt token"):
        pj.generate(layers, variables, [], 3, context=CONTEXT, key=jax.random.key(0))


def test_loss_evaluator_weighs_chunks_by_their_size(model):
    layers, variables = model
    x, y = pj.data.evaluation_windows(np.arange(90, dtype=np.uint8), CONTEXT)
    assert len(x) == 11  # chunks of 4, 4, 3
    whole = pj.losses.next_token(pj.apply_layers(layers, variables, jnp.asarray(x), train=False),
                                 jnp.asarray(y))
    assert pj.loss_evaluator(layers, pj.losses.next_token, batch=4)(variables, x, y) == (
        pytest.approx(float(whole), rel=1e-6))
