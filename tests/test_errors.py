"""Bad input gets a clear error naming the culprit, never a deep XLA traceback."""

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pipejax as pj
from pipejax.errors import ArgumentTypeError, BatchError, ConfigError, DeviceError, LayerError

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
    with pytest.raises(BatchError, match=r"inputs of 18 examples.*microbatches=4.*18 % 4 = 2"):
        pipe.value_and_grad(params, (jnp.zeros((18, 20)), jnp.zeros((18,), jnp.int32)))
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(params)
    with pytest.raises(BatchError, match="microbatches=4"):
        trainer.step(state, (jnp.zeros((18, 20)), jnp.zeros((18,), jnp.int32)))


def test_batch_of_the_wrong_feature_shape():
    pipe = build()
    with pytest.raises(BatchError, match=r"inputs float32\[4, 21\] give layer 0 \(Dense\) "
                       r"variables .*built for micro-batches float32\[4, 20\]"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)),
                            (jnp.zeros((8, 21)), jnp.zeros((8,), jnp.int32)))


def test_targets_of_the_wrong_shape():
    pipe = build()
    with pytest.raises(BatchError, match=r"targets float32\[8, 3\].*int32\[4\].*give targets"):
        pipe.value_and_grad(pipe.init(jax.random.key(0)), (jnp.zeros((8, 20)), jnp.zeros((8, 3))))


def test_a_loss_that_does_not_fit_the_outputs():
    with pytest.raises(LayerError, match=r"the loss cannot take outputs float32\[4, 10\] and "
                                         r"targets float32\[4, 3\].*targets="):
        build(loss=pj.losses.mse, targets=jnp.zeros((4, 3)))
    with pytest.raises(LayerError, match=r"the loss returns float32\[4\].*one float"):
        build(loss=lambda out, y: jnp.mean(out, axis=-1))
    with pytest.raises(LayerError, match=r"need targets \[2, 8\]") as err:  # the loss's own hint
        pj.pipeline(pj.models.gpt(depth=1, width=16, heads=2, context=8),
                    loss=pj.losses.next_token, example=jnp.zeros((2, 8), jnp.int32), stages=1,
                    microbatches=1)
    assert str(err.value).count("give pj.pipeline(targets=...)") == 1
    with pytest.raises(LayerError, match=r"outputs float32\[10\] and targets int32\[20\].*"
                       r"differ in their first axis, \[10, 20\]: is pj.pipeline's example one "
                       "micro-batch, its batch axis first"):  # an example without its batch axis
        pj.pipeline(pj.models.mlp(depth=2, width=16), loss=pj.losses.cross_entropy,
                    example=jnp.zeros((20,)), stages=1, microbatches=1)


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


def test_a_mesh_axis_pipejax_does_not_know():
    """A "model" axis is not read as more replicas: it is named, with the axes pipejax knows."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "stage", "model"))
    with pytest.raises(ConfigError, match=r"mesh axes \('data', 'stage', 'model'\): pipejax does "
                                          r"not know 'model'; its axes are 'stage': "):
        build(mesh=mesh)


def test_a_rule_over_an_axis_the_mesh_lacks():
    pipe = build(mesh=pj.make_mesh(2, 2))
    with pytest.raises(ConfigError, match=r"rule 'adpsgd' names mesh axis 'node', but the mesh "
                                          r"has axes \('data', 'stage'\)"):
        pipe.trainer(optax.sgd(0.1), rule=pj.transforms.adpsgd("node"))
    with pytest.raises(ConfigError, match=r"names the mesh axis 'stage'"):
        pipe.trainer(optax.sgd(0.1), rule=pj.transforms.adpsgd("stage"))
    with pytest.raises(ArgumentTypeError, match="DataRule.*not GradientTransformation"):
        pipe.trainer(optax.sgd(0.1), rule=pj.transforms.gossip("data"))


def test_a_rule_that_leaves_a_data_axis_alone():
    pipe = build(mesh=pj.make_mesh(2, 4, nodes=2))
    with pytest.raises(ConfigError, match=r"data axis 'local' \(2 replicas\) is in none.*hadpsgd"):
        pipe.trainer(optax.sgd(0.1), rule=pj.transforms.adpsgd("node"))


def test_a_batch_that_does_not_split_over_the_replicas():
    pipe = build(mesh=pj.make_mesh(2, 2))
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)))
    with pytest.raises(BatchError, match=r"split into 2 data replicas x microbatches=2 "
                                          r"micro-batches of \[3, 20\].*shape \[16, 20\]"):
        trainer.step(state, (jnp.zeros((12, 20)), jnp.zeros(12, jnp.int32)))
    with pytest.raises(BatchError, match=r"18 examples do not split into 2 data replicas x "
                                          r"microbatches=2 \(18 % 4 = 2\)"):
        trainer.step(state, (jnp.zeros((18, 20)), jnp.zeros(18, jnp.int32)))


def test_devices_that_cannot_form_the_mesh():
    with pytest.raises(DeviceError, match=r"4 replicas x 4 stages need 16 devices but JAX "
                                          r"sees 8.*fewer stages or replicas"):
        pj.make_mesh(4, 4)
    with pytest.raises(ConfigError, match=r"data=3 replicas do not split into nodes=2"):
        pj.make_mesh(2, 3, nodes=2)


def test_one_copy_of_the_parameters_where_one_is_expected():
    pipe = build(mesh=pj.make_mesh(2, 2))
    trainer = pipe.trainer(optax.sgd(0.1))
    state = trainer.init(pipe.init(jax.random.key(0)))
    with pytest.raises(ArgumentTypeError, match=r"these hold 2 replicas.*replica=r"):
        pipe.value_and_grad(state.params, (jnp.zeros((16, 20)), jnp.zeros(16, jnp.int32)))
    with pytest.raises(ArgumentTypeError, match=r"replica=2; use 0 to 1 or 'mean'"):
        pj.unstage(state, 2)


def test_a_model_with_dropout_needs_a_key():
    pipe = build(pj.models.mlp(2, 16, 10, dropout=0.5))
    assert [s.name for s in pipe.random_layers] == ["Dropout", "Dropout"]
    params = pipe.init(jax.random.key(0))
    x, y = jnp.zeros((8, 20)), jnp.zeros((8,), jnp.int32)
    with pytest.raises(ConfigError, match=r"layers 2 \(Dropout\), 5 \(Dropout\).*pass "
                                          r"value_and_grad a key"):
        pipe.value_and_grad(params, (x, y))
    with pytest.raises(ConfigError, match="pass trainer.init a key"):
        pipe.trainer(optax.sgd(0.1)).init(params)
    pipe.value_and_grad(params, (x, y), jax.random.key(1))
    assert not build().random_layers  # no randomness: no key needed
    build().value_and_grad(build().init(jax.random.key(0)), (x, y))


def test_params_of_another_pipeline():
    pipe, other = build(), build(pj.models.mlp(2, 8, 10))
    with pytest.raises(ArgumentTypeError, match="packed for another pipeline"):
        pipe.trainer(optax.sgd(0.1)).init(other.init(jax.random.key(0)))
    with pytest.raises(ArgumentTypeError, match="value_and_grad takes this pipeline's Staged"):
        pipe.value_and_grad(pj.unstage(pipe.init(jax.random.key(0))), (jnp.zeros((8, 20)),
                                                                        jnp.zeros((8,), jnp.int32)))


def test_stage_checks_every_layer():
    pipe = build()
    variables = pj.unstage(pipe.init(jax.random.key(0)))
    variables[2] = {"params": {"bias": jnp.zeros(16), "kernel": jnp.zeros((15, 16))}}
    with pytest.raises(ConfigError, match=r"layer 2 \(Dense\) has variables .*float32\[16, 16\].*"
                                          r"given .*float32\[15, 16\]"):
        pipe.stage(variables)


def test_mesh_of_the_wrong_size():
    mesh = Mesh(np.array(jax.devices()[:4]), ("stage",))
    with pytest.raises(ConfigError, match="4 devices but stages=2"):
        build(mesh=mesh)


def test_optimizer_of_the_wrong_type():
    pipe = build()
    with pytest.raises(ArgumentTypeError, match="optimizer must be an optax GradientTransformation"):
        pipe.trainer("adam")
    with pytest.raises(TypeError, match=r"returned float for stage 0"):
        pipe.trainer(lambda info: 0.1)
    with pytest.raises(ArgumentTypeError, match=r"the function adam that makes one .*adam\(lea"):
        pipe.trainer(optax.adam)
    with pytest.raises(ArgumentTypeError, match=r"the class GradientTransformation \(pass an"):
        pipe.trainer(optax.GradientTransformation)
    with pytest.raises(ArgumentTypeError, match=r"calling the optimizer function with StageInfo"):
        pipe.trainer(lambda: optax.sgd(0.1))
    with pytest.raises(ArgumentTypeError, match=r"Mitigation; pass its .optimizer"):
        pipe.trainer(pj.transforms.mitigation("none", 0.1))


def test_unstage_of_something_else():
    with pytest.raises(TypeError, match="unstage expects the Staged parameters"):
        pj.unstage({"w": 1})


def test_every_raised_error_is_a_pipejax_error():
    """STYLE: errors are classes defined in pipejax/errors.py, never bare built-ins."""
    root = pathlib.Path(pj.__file__).parent
    ours = {name for name, obj in vars(pj.errors).items() if isinstance(obj, type)}
    raised = {(path.relative_to(root).as_posix(), name)
              for path in root.rglob("*.py")
              for name in re.findall(r"raise ([A-Z]\w*)\(", path.read_text())}
    assert raised and {r for r in raised if r[1] not in ours} == set()


def test_an_optimizer_of_the_wrong_kind_says_what_to_pass():
    """A name, an optax factory given uncalled (alone, in a partial, or the
    user's own, which would take the StageInfo for its learning rate and fail
    only inside the step) and a class: each named, with what to pass."""
    import functools

    def my_sgd(learning_rate, momentum=0.9):
        return optax.sgd(learning_rate, momentum)

    pipe = build()
    cases = [
        ("adam", r"^pipe.trainer got str 'adam': pass optax.adam\(1e-3\); the optimizer must be"),
        (optax.adam, r"^pipe.trainer got the function adam that makes one transform \(optax.adam\)"
                     r", not the transform itself: call it, optax.adam\(learning_rate\), e.g. "
                     r"optax.adam\(1e-3\)$"),
        (functools.partial(optax.adam, b1=0.8), r"got the function adam .*\(functools.partial"
                                                r"\(optax.adam, ...\)\).*: call it with its hyper"
                                                r"-parameters, e.g. f\(learning_rate=1e-3\)"),
        (my_sgd, r"got the function my_sgd that makes one transform \(.*my_sgd\).*call it"),
        (optax.GradientTransformation, r"^pipe.trainer got the class GradientTransformation "
                                       r"\(pass an instance, not the class\): the optimizer must"),
        (optax.inject_hyperparams(optax.adam), r"got the function adam that makes one transform "
                                               r"\(a wrapper of optax.adam\).*: call it with its "
                                               r"hyper-parameters"),
    ]
    for optimizer, message in cases:  # a ConfigError and an ArgumentTypeError (a TypeError)
        with pytest.raises(pj.errors.OptimizerError, match=message) as caught:
            pipe.trainer(optimizer)
        assert isinstance(caught.value, ConfigError) and isinstance(caught.value, TypeError)
    assert pipe.trainer(lambda info: optax.sgd(0.1 / (1 + info.delay))).optimizers  # still fine
