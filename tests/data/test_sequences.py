"""Sequences of several lengths: padded to the next of a few lengths, the
masked loss is the loss of the real tokens; packed with document ids, the zoo
GPT computes what each document alone would, pipelined too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pipejax as pj
from tests.reference import assert_pipelines_exactly, rel_err

SIZE = dict(depth=2, width=32, heads=4, context=16)


def _documents(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n) for n in lengths]


def _variables(layers, x):
    """Each linen layer initialized by Flax on the previous one's output."""
    out, h = [], x
    for i, layer in enumerate(layers):
        out.append(layer.init(jax.random.key(i), h))
        h = layer.apply(out[-1], h)
    return out


def test_pad_to_lengths_picks_the_shortest_length_that_holds_the_batch():
    docs = _documents([5, 9, 3])
    padded = pj.data.pad_to_lengths(docs, lengths=[4, 8, 16])
    x, (y, mask) = padded.batch
    assert x.shape == y.shape == mask.shape == (3, 8) and x.dtype == np.int32
    np.testing.assert_array_equal(x[1], docs[1][:-1])
    np.testing.assert_array_equal(y[1], docs[1][1:])
    np.testing.assert_array_equal(mask.sum(1), [4, 8, 2])
    assert padded.padding == pytest.approx(1 - 14 / 24)
    with pytest.raises(pj.errors.DataError, match=r"sequence 1 of 9 tokens needs 8 positions.*"
                       r"lengths \[4, 6\]"):
        pj.data.pad_to_lengths(docs, lengths=[6, 4])


def test_pack_documents_fills_rows_in_order():
    docs = _documents([5, 4, 9, 30])
    packed = pj.data.pack_documents(docs, length=8, rows=6)
    (x, segments), (y, mask) = packed.batch
    assert x.shape == (6, 8)
    np.testing.assert_array_equal(segments[0], [1, 1, 1, 1, 2, 2, 2, 0])  # 4 + 3 positions
    np.testing.assert_array_equal(x[1], docs[2][:-1])  # 8 positions: a row of its own
    # 30 tokens: pieces of 9, 9, 9 and 6 tokens (overlapping by one), each its own document
    np.testing.assert_array_equal(segments[2:5].max(1), [1, 1, 1])
    assert mask[5].sum() == 5 and packed.padding == pytest.approx(1 - 44 / 48)
    with pytest.raises(pj.errors.DataError, match=r"fill 6 rows of 8 positions, more than rows=2"):
        pj.data.pack_documents(docs, length=8, rows=2)


@pytest.mark.parametrize("api", ["linen", pytest.param("nnx", marks=pytest.mark.slow)])
def test_a_packed_row_computes_each_document_alone(api):
    layers = pj.models.gpt(**SIZE, api=api, rngs=nnx.Rngs(0) if api == "nnx" else None)
    docs = _documents([6, 4, 7], seed=1)
    (x, segments), _ = pj.data.pack_documents(docs, length=16).batch
    run = jax.jit(lambda v, h: pj.apply_layers(layers, v, h, train=False))
    variables = (_variables(layers, jnp.asarray(x)) if api == "linen"
                 else [nnx.state(m) for m in layers])
    packed = run(variables, (jnp.asarray(x), jnp.asarray(segments)))
    at = 0
    for d in docs:
        alone = run(variables, jnp.asarray(d[:-1])[None])
        np.testing.assert_allclose(packed[0, at:at + len(d) - 1], alone[0], atol=2e-5)
        at += len(d) - 1


def test_masked_loss_of_a_padded_bucket_is_the_loss_of_its_tokens():
    logits = jax.random.normal(jax.random.key(0), (2, 8, 256))
    y = jax.random.randint(jax.random.key(1), (2, 8), 0, 256)
    mask = jnp.arange(8) < 5
    mask = jnp.broadcast_to(mask, (2, 8))
    assert rel_err(pj.losses.next_token(logits, (y, mask)),
                   pj.losses.next_token(logits[:, :5], y[:, :5])) < 1e-6
    with pytest.raises(pj.errors.BatchError, match=r"a mask \[2, 5\] for targets \[2, 8\]"):
        pj.losses.next_token(logits, y, mask[:, :5])


def test_packed_rows_pipeline_as_the_sequential_model():
    layers = pj.models.gpt(**SIZE)
    M, MB, T = 2, 2, 16
    (x, segments), (y, mask) = pj.data.pack_documents(
        _documents([6, 4, 9, 12, 3, 17, 5], seed=2), length=T, rows=M * MB).batch
    example = (jnp.zeros((MB, T), jnp.int32),) * 2
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=example,
                       targets=(jnp.zeros((MB, T), jnp.int32), jnp.zeros((MB, T), bool)),
                       stages=2, microbatches=M, schedule="1f1b")
    assert_pipelines_exactly(pipe, layers, pipe.init(jax.random.key(0)),
                             ((x, segments), (y, mask)), pj.losses.next_token)
