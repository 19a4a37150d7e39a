"""Generation and evaluation of a language model outside the pipeline."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


@pytest.mark.parametrize("prompt, variables, context, said", [
    ([[1, 2], [3, 4]], None, CONTEXT, r"prompt of shape \(2, 2\); give one sequence"),
    ([1.5, 2.0], None, CONTEXT, "give integer token ids"),
    ("Once", None, CONTEXT, "is text; give its tokens, e.g. pj.data.encode"),
    ([3, 256, -1], None, CONTEXT, r"prompt ids \[-1, 256\] outside the vocabulary \[0, 256\)"),
    ([1, 2], None, 4 * CONTEXT, "cannot take 12 tokens at once .context=32.*position table"),
    ([1, 2], "staged", CONTEXT, r"a pipeline's Staged; give one entry per layer, pj.unstage"),
])
def test_a_prompt_or_model_that_does_not_fit_is_named(model, prompt, variables, context, said):
    """Never a silent flattened batch, a NaN's token 0 or a broadcasting error."""
    layers, values = model
    if variables == "staged":
        example = jnp.zeros((1, CONTEXT), jnp.int32)
        values = pj.pipeline(layers, loss=pj.losses.next_token, example=example,
                             targets=example, stages=1, microbatches=1).init(jax.random.key(0))
    with pytest.raises(pj.errors.ConfigError, match=said):
        pj.generate(layers, values, prompt, 10, context=context, key=jax.random.key(0))


def test_decode_steps_give_the_logits_of_the_whole_window(model):
    """Token by token through every layer's cache: each position's logits
    are those of the layers run on the whole window."""
    layers, variables = model
    tokens = jnp.asarray([[5, 9, 200, 7, 7, 31, 0, 255]])
    whole = pj.apply_layers(layers, variables, tokens, train=False)[0]
    wrapped = pj.layers.layer_list(layers)
    decoders = [layer.decoder() for layer in wrapped]
    h, caches = jax.ShapeDtypeStruct((1, CONTEXT), jnp.int32), []
    for layer, d, v in zip(wrapped, decoders, variables):
        caches.append(d.init(v, h))
        h = jax.eval_shape(lambda x, v=v, layer=layer: layer.apply(v, x, train=False), h)
    for t in range(CONTEXT):
        h = tokens[:, t:t + 1]
        for i, (d, v) in enumerate(zip(decoders, variables)):
            h, caches[i] = d.step(v, caches[i], h)
        np.testing.assert_allclose(h[0, 0], whole[t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cache_gives_the_tokens_of_recomputation(model, temperature):
    """Within the context and past it (where the cached part hands over to
    the sliding window), greedy and drawn."""
    layers, variables = model
    for length in (2, 14):
        run = lambda cache: pj.generate(layers, variables, [3, 1, 4], length, context=CONTEXT,
                                        key=jax.random.key(5), temperature=temperature,
                                        cache=cache)
        assert run(True).tolist() == run(False).tolist()


def test_one_program_serves_generations_of_equal_settings(model):
    layers, variables = model
    run = lambda seed: pj.generate(layers, variables, [1, 2, 3], 4, context=CONTEXT,
                                   key=jax.random.key(seed))
    run(0)
    before = pj.cache_sizes()["generators"]
    run(1)
    assert pj.cache_sizes()["generators"] == before >= 1


def test_the_nnx_twin_decodes_as_it_recomputes():
    layers = pj.models.gpt(depth=1, width=16, heads=2, context=CONTEXT, api="nnx",
                           rngs=nnx.Rngs(0))
    variables = [nnx.state(m, nnx.Param) for m in layers]
    run = lambda cache: pj.generate(layers, variables, [3, 1, 4], 10, context=CONTEXT,
                                    key=jax.random.key(5), temperature=0, cache=cache)
    assert run(True).tolist() == run(False).tolist()


def test_a_layer_without_a_decode_step_recomputes(model):
    layers, variables = model
    with_function = [*layers, lambda logits: logits * 2.0]
    kw = dict(context=CONTEXT, key=jax.random.key(0), temperature=0)
    out = pj.generate(with_function, [*variables, {}], [1, 2], 4, **kw)
    assert out.tolist() == pj.generate(layers, variables, [1, 2], 4, **kw).tolist()
    with pytest.raises(pj.errors.ConfigError, match=r"layer 3 \(lambda\) offers no decode step"):
        pj.generate(with_function, [*variables, {}], [1, 2], 4, cache=True, **kw)


@pytest.mark.slow  # the evaluator runs in the language model's CLI test
def test_loss_evaluator_weighs_chunks_by_their_size(model):
    layers, variables = model
    x, y = pj.data.evaluation_windows(np.arange(90, dtype=np.uint8), CONTEXT)
    assert len(x) == 11  # chunks of 4, 4, 3
    whole = pj.losses.next_token(pj.apply_layers(layers, variables, jnp.asarray(x), train=False),
                                 jnp.asarray(y))
    assert pj.loss_evaluator(layers, pj.losses.next_token, batch=4)(variables, x, y) == (
        pytest.approx(float(whole), rel=1e-6))
