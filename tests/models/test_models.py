"""Every model of the zoo is a layer list that pipelines exactly (4 stages, GPipe)."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.models.common import Conv, flatten
from pipejax.models.snn import AlphaDropout
from tests.reference import rel_err, sequential_value_and_grad

MB, M = 2, 4
SIGNAL = (40,)
IMAGE = (8, 8, 1)

# The block ResNet in 1-D: its blocks run in resnet-2d, its 1-D convolutions in resnet-fine.
CASES = {
    "mlp": (lambda: pj.models.mlp(depth=3, width=32), SIGNAL),
    "snn": (lambda: pj.models.snn(depth=6, width=32, dropout=0.1), SIGNAL),
    "resnet-2d": (lambda: pj.models.resnet(depth=2, width=8, groups=4, dims=2), IMAGE),
    "resnet-fine": (lambda: pj.models.resnet(depth=2, width=8, groups=4, fine=True), SIGNAL),
    "vgg-1d": (lambda: pj.models.vgg((8, "M", 16, "M"), dense=32), SIGNAL),
    "vgg-2d": (lambda: pj.models.vgg((8, "M", 16, "M"), dims=2, dense=32, groups=4), IMAGE),
    "transformer": (lambda: pj.models.transformer(layers=3, dim=16, heads=2, dropout=0.1), SIGNAL),
    "residual_lstm": (lambda: pj.models.residual_lstm(layers=3, hidden=16), SIGNAL),
}


SLOW = {"resnet-2d", "resnet-fine", "transformer", "residual_lstm"}  # 10-17 s each


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in sorted(CASES)])
def test_model_pipelines_exactly(name):
    build, shape = CASES[name]
    layers = build()
    assert isinstance(layers, list) and len(layers) >= 4
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, *shape)),
                       stages=4, microbatches=M)
    assert "padding" in str(pipe) and len(pipe.plan.split) == 4
    params = pipe.init(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (M * MB, *shape))
    y = jax.random.randint(ky, (M * MB,), 0, 10)
    key = jax.random.key(2)
    loss, grads = pipe.value_and_grad(params, (x, y), key)
    ref_loss, ref_grads = sequential_value_and_grad(layers, M)(pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


@pytest.mark.parametrize("dims, window, strides", [(1, 3, 1), (1, 3, 2), (1, 1, 2), (2, 3, 2),
                                                   (2, 5, 3)])
def test_conv_is_flax_conv(dims, window, strides):
    """The zoo's Conv (a product of windows) has nn.Conv's parameters and result."""
    x = jax.random.normal(jax.random.key(1), (2, 9, 8, 3)[:dims + 1] + (3,))
    ours = Conv(5, (window,) * dims, strides)
    flax_conv = nn.Conv(5, (window,) * dims, strides)
    variables = flax_conv.init(jax.random.key(0), x)
    chex.assert_trees_all_equal(ours.init(jax.random.key(0), x), variables)
    chex.assert_trees_all_close(ours.apply(variables, x), flax_conv.apply(variables, x),
                                atol=1e-5)


def test_fine_resnet_is_the_block_resnet_split_finer():
    """One block as three layers (fork, conv, sum) computes the block."""
    block = pj.models.resnet(depth=2, width=8, groups=4)
    fine = pj.models.resnet(depth=2, width=8, groups=4, fine=True)
    assert len(fine) == len(block) + 2 * 2
    x = jax.random.normal(jax.random.key(1), (2, 40))
    params = pj.pipeline(block, loss=pj.losses.cross_entropy, example=x, stages=1,
                         microbatches=1).init(jax.random.key(0))
    variables = pj.unstage(params)
    # a block's GroupNorm_0, [Conv_0: projection], Conv: first, GroupNorm_1, Conv: second;
    # the fork's GroupNorm_0, Conv_0: first, [Conv_1: projection]; the conv's GroupNorm_0, Conv_0
    split = []
    for v in variables[2:4]:
        p = v["params"]
        project = "Conv_2" in p
        first, second = ("Conv_1", "Conv_2") if project else ("Conv_0", "Conv_1")
        fork = {"GroupNorm_0": p["GroupNorm_0"], "Conv_0": p[first]}
        if project:
            fork["Conv_1"] = p["Conv_0"]
        split += [{"params": fork},
                  {"params": {"GroupNorm_0": p["GroupNorm_1"], "Conv_0": p[second]}}, {}]
    fine_vars = variables[:2] + split + variables[4:]
    run = lambda layers, v: pj.apply_layers(layers, v, x, train=False)
    chex.assert_trees_all_close(run(fine, fine_vars), run(block, variables), atol=1e-5)


def test_alpha_dropout_keeps_selu_statistics():
    layer = AlphaDropout(0.2)
    x = jax.random.normal(jax.random.key(0), (200_000,))
    out = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert abs(float(out.mean())) < 0.01 and abs(float(out.std()) - 1.0) < 0.01
    assert (layer.apply({}, x, deterministic=True) == x).all()


def test_flatten_names_itself_in_the_plan():
    specs = pj.trace([flatten] + pj.models.mlp(1, 8), jnp.zeros((2, 4, 5)))
    assert specs[0].name == "flatten" and specs[0].output.shape == (2, 20)
