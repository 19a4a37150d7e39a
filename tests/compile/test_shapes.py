"""One pipeline at several sequence lengths: a trainer trains T = 16 and T = 8
batches alternately on one state, each step equal to a plain `jax.jit` of the
same model, one compile per shape; the bounds and mismatches are clear errors."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from tests.reference import assert_pipelines_exactly, rel_err, sequential_loss

MB, M, T = 2, 4, 16
LAYERS = pj.models.gpt(depth=1, width=32, heads=4, context=T)


def _pipeline(layers=LAYERS, stages=2, **kw):
    kw = {"schedule": "1f1b", **kw}
    return pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((MB, T), jnp.int32),
                       targets=jnp.zeros((MB, T), jnp.int32), stages=stages, microbatches=M, **kw)


def _tokens(seed, length):
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.randint(kx, (M * MB, length), 0, 256),
            jax.random.randint(ky, (M * MB, length), 0, 256))


class _Compiles(logging.Handler):
    """The programs JAX compiles while it is attached (`jax.log_compiles`)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling "):
            self.names.append(message.split()[1])


def test_one_state_trains_two_lengths_as_plain_jit():
    pipe = _pipeline()
    params = pipe.init(jax.random.key(0))
    opt = optax.adamw(1e-2)
    trainer = pipe.trainer(opt)
    state = trainer.init(params)
    key = jax.random.key(0)

    @jax.jit
    def plain(v, s, x, y):
        loss, g = jax.value_and_grad(
            lambda v: sequential_loss(LAYERS, v, x, y, M, key, pj.losses.next_token))(v)
        u, s = opt.update(g, s, v)
        return optax.apply_updates(v, u), s, loss

    v = pj.unstage(params)
    s = opt.init(v)
    batches = [_tokens(i, T if i % 2 == 0 else T // 2) for i in range(4)]
    compiles = _Compiles()
    logging.getLogger("jax").addHandler(compiles)
    try:
        with jax.log_compiles():
            for batch in batches:
                state, metrics = trainer.step(state, batch)
                v, s, loss = plain(v, s, *batch)
                assert rel_err(metrics["loss"], loss) < 1e-5
    finally:
        logging.getLogger("jax").removeHandler(compiles)
    assert compiles.names.count("jit(step)") == 2  # one program per length
    assert int(state.step) == 4
    assert rel_err(pj.unstage(state.params), v) < 1e-3  # Adam's first steps amplify rounding


def test_value_and_grad_at_another_length_is_the_sequential_model():
    pipe = _pipeline()
    params = pipe.init(jax.random.key(0))
    assert_pipelines_exactly(pipe, LAYERS, params, _tokens(1, T // 2), pj.losses.next_token)
    assert [pipe.shapes.keys[1][0][1]] == [(T // 2,)]


def test_shape_bounds_and_mismatches_are_clear_errors():
    pipe = _pipeline(max_shapes=1)
    params = pipe.init(jax.random.key(0))
    with pytest.raises(pj.errors.BatchError, match=r"past max_shapes=1 .*pad_to_lengths"):
        pipe.value_and_grad(params, _tokens(0, T // 2))
    # Longer than the position table: the embedding layer says so.
    with pytest.raises(pj.errors.LayerError, match=r"layer 0 \(TokenEmbed\) cannot take input "
                       r"int32\[2, 32\] produced by a batch of other micro-batches than the "
                       r"pipeline's int32\[2, 16\] \(a language model takes windows up to its "
                       r"context\)"):
        _pipeline().value_and_grad(params, _tokens(0, 2 * T))
    # An asynchronous table keeps micro-batches of one shape in flight.
    asynchronous = _pipeline(schedule="pipedream")
    trainer = asynchronous.trainer(optax.sgd(0.1))
    state = trainer.abstract_state(asynchronous.init(jax.random.key(0)), jax.random.key(0))
    with pytest.raises(pj.errors.BatchError, match=r"'pipedream' keeps micro-batches of "
                       r"int32\[·, 16\].*in flight"):
        trainer.step(state, _tokens(0, T // 2))
    # A state of another partition names both.
    other = _pipeline(partition=[1, 2])
    with pytest.raises(pj.errors.ArgumentTypeError,
                       match=r"layers per device \[1, 2\], this pipeline's \[2, 1\]"):
        pipe.value_and_grad(other.init(jax.random.key(0)), _tokens(0, T))
    state = other.trainer(optax.sgd(0.1)).abstract_state(other.init(jax.random.key(0)),
                                                         jax.random.key(0))
    with pytest.raises(pj.errors.ArgumentTypeError, match=r"trainer.step got Staged parameters "
                       r"packed for another pipeline \(its layers per device \[1, 2\]"):
        pipe.trainer(optax.sgd(0.1)).step(state, _tokens(0, T))


def test_tokens_of_any_integer_dtype_train_as_the_pipelines():
    """uint8 or uint16 tokens (as corpora are stored) and NumPy's int64 are
    cast to the pipeline's int32, at its own length and at another; a float
    batch of a token pipeline stays an error."""
    pipe = _pipeline()
    params = pipe.init(jax.random.key(0))
    for length in (T, T // 2):
        x, y = (np.asarray(a) for a in _tokens(0, length))
        want = jax.tree.leaves(pipe.value_and_grad(params, (x, y)))
        for dtype in (np.uint8, np.uint16, np.int64):
            got = jax.tree.leaves(pipe.value_and_grad(params, (x.astype(dtype), y.astype(dtype))))
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(pj.errors.BatchError, match="dtype int32"):
        pipe.value_and_grad(params, (x.astype(np.float32), y))


def test_parameters_that_depend_on_the_length_are_named():
    layers = [nn.Embed(256, 4), lambda h: h.reshape(h.shape[0], -1), nn.Dense(256)]
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, T), jnp.int32), stages=2, microbatches=M,
                       partition=[2, 1])
    x, _ = _tokens(0, T // 2)
    with pytest.raises(pj.errors.BatchError, match=r"int32\[2, 8\] give layer 2 \(Dense\) "
                       r"variables .* its parameters depend on the input's shape"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)), (x, x[:, 0]))
