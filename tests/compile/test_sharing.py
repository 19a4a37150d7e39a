"""Stages of identical structure share one switch branch, with unchanged results."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from tests.reference import batch, rel_err, sequential_value_and_grad

MB = 4


def _blocks(n: int) -> list:
    return [layer for _ in range(n) for layer in (nn.Dense(16), nn.relu, nn.Dropout(0.3))] + [
        nn.Dense(10)]


def _pipe(layers, K, split=None, M=2):
    return pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 20)),
                       stages=K, microbatches=M, partition=split or "variance")


def test_identical_middle_stages_share_a_branch_and_equal_sequential():
    layers = _blocks(6)
    pipe = _pipe(layers, 4, split=[6, 3, 3, 7])
    # the first stage reads the batch, the last ends in the loss: 3 structures
    assert pipe.build.code.groups.of == (0, 1, 1, 2)
    params = pipe.init(jax.random.key(1))
    x, y = batch(2 * MB)
    key = jax.random.key(5)  # dropout: stages 1 and 2 must use their own layers' keys
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    ref_loss, ref_grads = sequential_value_and_grad(layers, 2)(pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5
    # every layer initializes with its own key, as on one stage
    one = _pipe(layers, 1).init(jax.random.key(1))
    for a, b in zip(jax.tree.leaves(pj.unstage(params)), jax.tree.leaves(pj.unstage(one))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_optimizer_branches_follow_transform_and_structure():
    pipe = _pipe(_blocks(6), 4, split=[6, 3, 3, 7])
    shared = pipe.trainer(optax.sgd(0.1, momentum=0.9))
    assert shared.optimizers.groups.of == (0, 1, 1, 2)
    own = pipe.trainer(lambda info: optax.sgd(0.1 / (1 + info.delay)))  # one transform per stage
    assert own.optimizers.groups.of == (0, 1, 2, 3)


def test_deep_model_compiles_one_branch_per_structure():
    layers = [layer for _ in range(16) for layer in (nn.Dense(8), nn.relu)] + [nn.Dense(3)]
    pipe = _pipe(layers, 8, split=[4] * 7 + [5])
    assert pipe.build.code.groups.of == (0, 1, 1, 1, 1, 1, 1, 2)
    # stages of different lengths (the variance split here) get their own branches
    uneven = _pipe(layers, 8)
    starts = {(r.start % 2, len(r)) for r in uneven.plan.ranges[1:-1]}
    assert len(uneven.build.code.groups) == len(starts) + 2


def test_a_stage_of_equal_layers_and_shapes_finds_its_residuals_once():
    """Pipelines of one layer list (pj.search builds many) work out a stage's
    residuals and split backward once per process for equal layers, shapes,
    remat and dtype; a stage holding an NNX layer is kept without its values."""
    from flax import nnx

    pj.clear_caches()  # what other tests built in this process is forgotten
    layers = [nn.Dense(16), nn.relu, nn.Dense(16), nn.relu, nn.Dense(4)]
    build = lambda schedule, mb=4, remat="none", ls=layers: pj.pipeline(
        ls, loss=pj.losses.cross_entropy, example=jnp.zeros((mb, 8)), stages=2,
        microbatches=4, schedule=schedule, remat=remat)
    gpipe = build("gpipe")
    assert pj.cache_sizes()["stage residuals"] == 2  # each stage once
    one = build("1f1b")
    assert pj.cache_sizes()["stage residuals"] == 2
    assert jax.tree.structure(one.build.code.kept) == jax.tree.structure(gpipe.build.code.kept)
    assert one.layout.kept.slot_bytes() == gpipe.layout.kept.slot_bytes() > 0
    build("1f1b", mb=8)  # other shapes
    assert pj.cache_sizes()["stage residuals"] == 4
    build("1f1b", remat="stage")  # another remat
    assert pj.cache_sizes()["stage residuals"] == 6
    zb = build("zb-h1")  # its split backwards: one per stage, then found again
    assert pj.cache_sizes()["stage residuals"] == 8
    assert build("zb-h1").build.code.splits == zb.build.code.splits
    assert pj.cache_sizes()["stage residuals"] == 8
    lin = [nnx.Linear(8, 16, rngs=nnx.Rngs(0)), *layers[1:]]
    build("1f1b", ls=lin)  # stage 0 is new, stage 1 equals
    assert pj.cache_sizes()["stage residuals"] == 9
    build("1f1b", ls=[nnx.Linear(8, 16, rngs=nnx.Rngs(1)), *layers[1:]])  # other values, one code
    assert pj.cache_sizes()["stage residuals"] == 9
