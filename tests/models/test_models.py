"""Every model of the zoo, in linen and in NNX, is a layer list that pipelines
exactly (4 stages, GPipe); the NNX twins have the linen models' shapes and
train as well."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pipejax as pj
from pipejax.models.common import Conv, flatten
from pipejax.models.snn import AlphaDropout
from tests.cases import fast_and_slow
from tests.reference import nnx_sequential_value_and_grad, rel_err, sequential_value_and_grad

MB, M = 2, 4
SIGNAL = (40,)
IMAGE = (8, 8, 1)

# The block ResNet in 1-D: its blocks run in resnet-2d, its 1-D convolutions in resnet-fine.
CASES = {
    "mlp": (lambda **kw: pj.models.mlp(depth=3, width=32, **kw), SIGNAL),
    "snn": (lambda **kw: pj.models.snn(depth=6, width=32, dropout=0.1, **kw), SIGNAL),
    "resnet-2d": (lambda **kw: pj.models.resnet(depth=2, width=8, groups=4, dims=2, **kw), IMAGE),
    "resnet-fine": (lambda **kw: pj.models.resnet(depth=2, width=8, groups=4, fine=True, **kw),
                    SIGNAL),
    "vgg-1d": (lambda **kw: pj.models.vgg((8, "M", 16, "M"), dense=32, **kw), SIGNAL),
    "vgg-2d": (lambda **kw: pj.models.vgg((8, "M", 16, "M"), dims=2, dense=32, groups=4, **kw),
               IMAGE),
    "transformer": (lambda **kw: pj.models.transformer(layers=3, dim=16, heads=2, dropout=0.1,
                                                       **kw), SIGNAL),
    "residual_lstm": (lambda **kw: pj.models.residual_lstm(layers=3, hidden=16, **kw), SIGNAL),
}


# Each layer kind once in `make test` (the NNX twins' shapes are checked below for all;
# a 2-D convolution in test_conv_is_flax_conv).
@pytest.mark.parametrize("name,api", fast_and_slow(
    [(n, api) for n in sorted(CASES) for api in ("linen", "nnx")],
    fast=[("mlp", "linen"), ("vgg-1d", "nnx")]))  # dropout in a pipeline: test_determinism.py
def test_model_pipelines_exactly(name, api):
    """Linen against the sequential run of the same layers, NNX against the
    sequential model written with Flax's own API."""
    build, shape = CASES[name]
    layers = build() if api == "linen" else build(api="nnx", inputs=shape, rngs=nnx.Rngs(0))
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
    reference = sequential_value_and_grad if api == "linen" else nnx_sequential_value_and_grad
    ref_loss, ref_grads = reference(layers, M)(pj.unstage(params), x, y, key)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


@pytest.mark.parametrize("name", sorted(CASES))
def test_nnx_twins_have_the_linen_models_shapes(name):
    """Layer by layer, the NNX twin takes and gives the linen model's shapes,
    holds parameters of the same shapes, and draws random numbers where it does."""
    build, shape = CASES[name]
    x = jnp.zeros((MB, *shape))
    linen, twin = pj.trace(build(), x), pj.trace(build(api="nnx", inputs=shape), x)
    describe = lambda s: (sorted(tuple(v.shape) for v in jax.tree.leaves(s.variables)),
                          jax.tree.map(lambda o: o.shape, s.output), s.random)
    assert [describe(s) for s in twin] == [describe(s) for s in linen]


@pytest.mark.slow  # 80 steps of training; the NNX twins pipeline exactly in the tests above
def test_nnx_mlp_trains_to_the_linen_accuracy():
    """The same MLP in both APIs, 80 steps on the 8x8 digits at K = 2: test
    accuracies within 3 points (the two differ in their initial draws only)."""
    data = pj.data.load("digits")
    x_train = data.x_train.reshape(len(data.x_train), -1).astype(np.float32)
    x_test = data.x_test.reshape(len(data.x_test), -1).astype(np.float32)
    results = {}
    for api in ("linen", "nnx"):
        layers = pj.models.mlp(2, 128, api=api, inputs=64, rngs=nnx.Rngs(0))
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((16, 64)),
                           stages=2, microbatches=4)
        trainer = pipe.trainer(optax.adam(3e-3))
        state = trainer.init(pipe.init(jax.random.key(0)))
        for step, (xb, yb) in zip(range(80), pj.data.batches(x_train, data.y_train, 64, 0, 0)):
            state, _ = trainer.step(state, (xb, yb))
        results[api] = pj.evaluator(layers)(pj.unstage(state), x_test, data.y_test)
    assert results["linen"] > 0.85
    assert abs(results["nnx"] - results["linen"]) < 0.03


def test_nnx_models_need_their_input_shape():
    with pytest.raises(pj.errors.ConfigError, match=r"pj.models.vgg\(api='nnx'\) needs inputs="):
        pj.models.vgg(api="nnx")
    with pytest.raises(pj.errors.ConfigError, match=r"api='torch'"):
        pj.models.mlp(api="torch")


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


@pytest.mark.slow  # each zoo model pipelines exactly in test_model_pipelines_exactly
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
