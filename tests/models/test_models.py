"""Every model of the zoo is a layer list that pipelines exactly (4 stages, GPipe)."""

import jax
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.models.common import flatten
from pipejax.models.snn import AlphaDropout
from tests.reference import rel_err, sequential_value_and_grad

MB, M = 2, 4
SIGNAL = (40,)
IMAGE = (8, 8, 1)

CASES = {
    "mlp": (lambda: pj.models.mlp(depth=3, width=32), SIGNAL),
    "snn": (lambda: pj.models.snn(depth=6, width=32, dropout=0.1), SIGNAL),
    "resnet-1d": (lambda: pj.models.resnet(depth=3, width=8, groups=4), SIGNAL),
    "resnet-2d": (lambda: pj.models.resnet(depth=3, width=8, groups=4, dims=2), IMAGE),
    "vgg-1d": (lambda: pj.models.vgg((8, "M", 16, "M"), dense=32), SIGNAL),
    "vgg-2d": (lambda: pj.models.vgg((8, "M", 16, "M"), dims=2, dense=32), IMAGE),
    "transformer": (lambda: pj.models.transformer(layers=3, dim=16, heads=2, dropout=0.1), SIGNAL),
    "residual_lstm": (lambda: pj.models.residual_lstm(layers=3, hidden=16), SIGNAL),
}


@pytest.mark.parametrize("name", sorted(CASES))
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


def test_alpha_dropout_keeps_selu_statistics():
    layer = AlphaDropout(0.2)
    x = jax.random.normal(jax.random.key(0), (200_000,))
    out = layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert abs(float(out.mean())) < 0.01 and abs(float(out.std()) - 1.0) < 0.01
    assert (layer.apply({}, x, deterministic=True) == x).all()


def test_flatten_names_itself_in_the_plan():
    specs = pj.trace([flatten] + pj.models.mlp(1, 8), jnp.zeros((2, 4, 5)))
    assert specs[0].name == "flatten" and specs[0].output.shape == (2, 20)
