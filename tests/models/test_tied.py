"""Tied input and output embeddings across stages: the pipeline computes the
tied model run in sequence (the shared matrix's gradient is the sum of both
uses), the copies stay bitwise equal under AdamW, the global norm counts the
matrix once, and a checkpoint holds one copy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import pipejax as pj
from pipejax import checkpoint_files as files
from tests.cases import fast_and_slow
from tests.reference import nnx_sequential_value_and_grad, rel_err, sequential_value_and_grad

MB, M, T = 2, 4, 16
SIZE = dict(depth=2, width=32, heads=4, context=T, tie_embeddings=True)
LAYERS = pj.models.gpt(**SIZE)
EMBED = ("params", "embed", "embedding")  # the shared matrix in TokenEmbed and LMHead


def _pipeline(layers=LAYERS, stages=2, schedule="1f1b", fsdp=1, tensor=1):
    x = jnp.zeros((MB, T), jnp.int32)
    mesh = pj.make_mesh(stages, fsdp=fsdp, tensor=tensor) if fsdp * tensor > 1 else None
    return pj.pipeline(layers, loss=pj.losses.next_token, example=x, targets=x, stages=stages,
                       microbatches=M, schedule=schedule, mesh=mesh)


def _tokens(seed=1, vocab=256):
    kx, ky = jax.random.split(jax.random.key(seed))
    return (jax.random.randint(kx, (M * MB, T), 0, vocab),
            jax.random.randint(ky, (M * MB, T), 0, vocab))


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _tied(grads, first, last):
    """The tied model's gradient: each copy's entry replaced by the sum of both."""
    total = _get(grads[0], first) + _get(grads[-1], last)
    for i, path in ((0, first), (-1, last)):
        *parent, leaf = path
        _get(grads[i], parent)[leaf] = total
    return grads


def _equals_the_tied_model(pipe, layers=LAYERS, vocab=256):
    """The copies start equal; loss and gradients are the tied model's in
    sequence (each copy's gradient the sum of both uses) to 1e-5."""
    params = pipe.init(jax.random.key(0))
    variables = nn.meta.unbox(pj.unstage(params))
    np.testing.assert_array_equal(_get(variables[0], EMBED), _get(variables[-1], EMBED))
    batch, key = _tokens(vocab=vocab), jax.random.key(0)
    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = sequential_value_and_grad(layers, M, pj.losses.next_token)(
        pj.unstage(params), *batch, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(nn.meta.unbox(pj.unstage(grads)),
                   _tied(nn.meta.unbox(ref_grads), EMBED, EMBED)) < 1e-5


@pytest.mark.parametrize("stages, schedule, fsdp, tensor", fast_and_slow([
    (1, "1f1b", 1, 1), (2, "1f1b", 1, 1), (4, "1f1b", 1, 1), (2, "interleaved", 1, 1),
    (2, "1f1b", 1, 2), (2, "1f1b", 2, 2), (2, "gpipe", 2, 1), (1, "1f1b", 2, 2)],
    fast=[(2, "1f1b", 2, 2)]))
def test_the_tied_gpt_pipelines_as_the_tied_model_in_sequence(stages, schedule, fsdp, tensor):
    """At tensor = 2 the shared matrix is split over its vocabulary (Megatron's
    vocabulary-parallel embedding and head share the split); over fsdp each
    device holds a piece of it, summed with the other copy's piece."""
    _equals_the_tied_model(_pipeline(stages=stages, schedule=schedule, fsdp=fsdp, tensor=tensor))


@pytest.mark.slow
@pytest.mark.parametrize("fsdp, tensor", [(2, 1), (2, 2)])
def test_copies_in_different_slots_are_summed_whole(fsdp, tensor):
    """A small vocabulary ranks the embedding below the blocks' kernels, by
    a different count on each stage: the copies sit in different slots, and
    their fsdp pieces are gathered whole to be summed."""
    layers = pj.models.gpt(**{**SIZE, "depth": 3}, vocab=64)
    pipe = _pipeline(layers, fsdp=fsdp, tensor=tensor)
    packing = pipe.build.code.params
    assert len({packing.leaves[d][n].slot for d, n in packing.tied[0]}) == 2
    _equals_the_tied_model(pipe, layers, vocab=64)


@pytest.mark.slow  # fast: the tied model's equality and its global norm
@pytest.mark.parametrize("stages, fsdp, tensor", [(4, 1, 1), (2, 1, 2), (2, 2, 2)])
def test_the_copies_stay_bitwise_equal_and_a_checkpoint_holds_one(tmp_path, stages, fsdp,
                                                                  tensor):
    pipe = _pipeline(stages=stages, fsdp=fsdp, tensor=tensor)
    trainer = pipe.trainer(optax.adamw(1e-2), clip_norm=1.0)
    state = trainer.init(pipe.init(jax.random.key(0)))
    for step in range(20):
        state, _ = trainer.step(state, _tokens(step))
    packing = pipe.build.code.params
    [((k0, n0), (k1, n1))] = packing.tied
    a, b = packing.leaves[k0][n0], packing.leaves[k1][n1]
    rows = [np.asarray(buffer) for buffer in state.params.buffers]
    np.testing.assert_array_equal(packing.from_slot(a, rows[a.slot][k0]),
                                  packing.from_slot(b, rows[b.slot][k1]))
    pj.save(tmp_path, trainer, state)
    manager = files.manager(tmp_path)
    saved = manager.restore(20, args=ocp.args.Composite(arrays=ocp.args.StandardRestore()))
    manager.close()
    assert [k for k in saved["arrays"] if "embed.embedding" in k and "opt" not in k] == [
        "layer0.params.embed.embedding.value"]
    again = pj.restore(tmp_path, trainer)
    for x, y in zip(jax.tree.leaves((state.params, state.opt_state)),
                    jax.tree.leaves((again.params, again.opt_state))):
        np.testing.assert_array_equal(x, y)
    values = pj.unstage(again)
    assert _get(values[0], EMBED).value is _get(values[-1], EMBED).value  # one array


@pytest.mark.slow  # the tied GPT's clip: a second trainer; the pipelined tie runs fast above
def test_the_global_norm_counts_the_shared_matrix_once():
    pipe = _pipeline(stages=1)  # across stages: the bitwise test above clips at K = 4
    params = pipe.init(jax.random.key(0))
    trainer = pipe.trainer(optax.sgd(1.0), clip_norm=0.1)
    state, _ = trainer.step(trainer.init(params), _tokens())
    _, grads = pipe.value_and_grad(params, _tokens())
    g = nn.meta.unbox(pj.unstage(grads))
    once = jax.tree.leaves(g[:-1]) + [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
        g[-1])[0] if "embed" not in jax.tree_util.keystr(path)]
    norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in once)))
    twice = float(jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(g))))
    assert norm > 0.1 and twice > 1.05 * norm  # the clip acts, and counting twice would differ
    moved = jax.tree.map(lambda new, old: old - new, nn.meta.unbox(pj.unstage(state)),
                         nn.meta.unbox(pj.unstage(params)))
    assert rel_err(moved, jax.tree.map(lambda d: d * 0.1 / norm, g)) < 1e-3


@pytest.mark.slow  # NNX ties are found in tests/layers/test_nnx.py; the sums are the linen path's
def test_the_nnx_twin_ties_its_embedding():
    layers = pj.models.gpt(**SIZE, api="nnx", rngs=nnx.Rngs(0))
    pipe = _pipeline(layers)
    params = pipe.init()
    batch, key = _tokens(), jax.random.key(0)
    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = nnx_sequential_value_and_grad(layers, M, pj.losses.next_token)(
        pj.unstage(params), *batch, key)
    assert rel_err(loss, ref_loss) < 1e-5
    ours, theirs = pj.unstage(grads), ref_grads
    total = ours[0]["embed"]["embedding"][...]
    np.testing.assert_allclose(total, ours[-1]["embed"]["embedding"][...])
    np.testing.assert_allclose(total, theirs[0]["embed"]["embedding"][...]
                               + theirs[-1]["embed"]["embedding"][...], atol=1e-6)


def test_tied_weights_on_an_asynchronous_table_are_a_clear_error():
    with pytest.raises(pj.errors.ConfigError, match=r"layers 0 \(TokenEmbed\) and 3 \(LMHead\) "
                       r"share a module .*'pipedream' updates each stage"):
        _pipeline(schedule="pipedream")

