"""Bad input gets a clear error naming the culprit, never a deep XLA traceback."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pipejax as pj
from pipejax.errors import BatchError, ConfigError, DeviceError, LayerError

EX = jnp.zeros((4, 20))


def build(layers=None, **kw):
    args = dict(loss=pj.losses.cross_entropy, example=EX, stages=2, microbatches=2)
    args.update(kw)
    return pj.pipeline(pj.models.mlp(2, 16, 10) if layers is None else layers, **args)


def test_layers_not_a_list():
    with pytest.raises(LayerError, match="must be a list.*Dense"):
        build(nn.Dense(10))


def test_empty_layer_list():
    with pytest.raises(LayerError, match="empty"):
        build([])


def test_more_stages_than_layers():
    with pytest.raises(ConfigError, match=r"stages=6 > 5 layers"):
        build(stages=6)


@pytest.mark.parametrize("stages", [0, -1])
def test_fewer_than_one_stage(stages):
    with pytest.raises(ConfigError, match=f"stages={stages}"):
        build(stages=stages)


def test_batch_not_divisible_by_microbatches():
    pipe = build(microbatches=4)
    params = pipe.init(jax.random.key(0))
    with pytest.raises(BatchError, match=r"batch of 18 examples.*microbatches=4.*18 % 4 = 2"):
        pipe.value_and_grad(params, (jnp.zeros((18, 20)), jnp.zeros((18,), jnp.int32)))
    state = pipe.init_state(params, optax.sgd(0.1))
    with pytest.raises(BatchError, match="microbatches=4"):
        pipe.step(state, (jnp.zeros((18, 20)), jnp.zeros((18,), jnp.int32)))


def test_batch_of_the_wrong_feature_shape():
    pipe = build()
    with pytest.raises(BatchError, match=r"\[8, 21\].*example \[4, 20\]"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)),
                            (jnp.zeros((8, 21)), jnp.zeros((8,), jnp.int32)))


def test_layer_whose_input_does_not_fit():
    layers = [nn.Dense(32), lambda x: x.reshape(x.shape[0], 40, 1), nn.Dense(10)]
    with pytest.raises(LayerError) as err:
        build(layers)
    msg = str(err.value)
    assert "layer 1 (lambda)" in msg and "float32[4, 32]" in msg and "(4, 40, 1)" in msg
    assert "layer 0 (Dense)" in msg  # the producer of the bad input


def test_conv_of_the_wrong_rank_names_the_layer():
    layers = [nn.Dense(8), nn.Conv(4, (3, 3)), nn.Dense(10)]
    with pytest.raises(LayerError, match=r"layer 1 \(Conv\) cannot take input float32\[4, 8\]"):
        build(layers)


def test_batchnorm_is_rejected_by_name():
    layers = [nn.Dense(8), nn.BatchNorm(use_running_average=False), nn.Dense(10)]
    with pytest.raises(LayerError, match=r"layer 1 \(BatchNorm\).*batch_stats.*GroupNorm"):
        build(layers)


def test_not_a_layer():
    with pytest.raises(LayerError, match=r"layer 1 \(int\)"):
        build([nn.Dense(8), 3, nn.Dense(10)])


def test_fewer_devices_than_stages():
    with pytest.raises(DeviceError, match=r"stages=9 needs 9 devices but JAX sees 8.*"
                                          r"xla_force_host_platform_device_count=9"):
        build(pj.models.mlp(5, 8, 10), stages=9)


def test_unknown_schedule():
    with pytest.raises(ConfigError, match="unknown schedule 'gpip'.*gpipe"):
        build(schedule="gpip")


def test_unknown_partition():
    with pytest.raises(ConfigError, match="unknown partition objective 'varience'"):
        build(partition="varience")
    with pytest.raises(ConfigError, match=r"partition \[1, 1\] covers 2 layers but the list has 5"):
        build(partition=[1, 1])


def test_unknown_remat():
    with pytest.raises(ConfigError, match="unknown remat 'full'"):
        build(remat="full")


def test_mesh_without_a_stage_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ConfigError, match=r"mesh axes \('data',\) have no 'stage' axis"):
        build(mesh=mesh)


def test_mesh_of_the_wrong_size():
    mesh = Mesh(np.array(jax.devices()[:4]), ("stage",))
    with pytest.raises(ConfigError, match="4 devices but stages=2"):
        build(mesh=mesh)


def test_step_before_init_state():
    with pytest.raises(ConfigError, match="init_state"):
        build().step  # noqa: B018


def test_optimizer_of_the_wrong_type():
    pipe = build()
    with pytest.raises(TypeError, match="optimizer must be an optax GradientTransformation"):
        pipe.init_state(pipe.init(jax.random.key(0)), "adam")


def test_unstage_of_something_else():
    with pytest.raises(TypeError, match="unstage expects the StagedParams"):
        pj.unstage({"w": 1})
