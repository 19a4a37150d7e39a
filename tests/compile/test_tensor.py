"""Parameters split over the mesh axis "tensor" by their Flax annotations,
under the pipeline (with FSDP and data replicas), on the real mesh.

The zoo GPT carries Megatron's layout: a synchronous table equals the
layers applied sequentially; an asynchronous trainer equals the same
schedule with fsdp = tensor = 1; the compiled step holds a quarter of the
parameters and optimizer state at fsdp 2 x tensor 2 and gathers no weight
over "tensor"; a bad annotation is an error naming the layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pipejax as pj
from pipejax.bench import hlo, peak_bytes
from pipejax.errors import ConfigError, LayerError
from tests.cases import fast_and_slow
from tests.reference import rel_err, sequential_value_and_grad

MB, M, CONTEXT, VOCAB = 4, 4, 16, 64


def _gpt(K, R=1, F=1, T=1, schedule="1f1b", api="linen", width=16):
    rngs = nnx.Rngs(0) if api == "nnx" else None
    layers = pj.models.gpt(depth=max(K - 2, 1), width=width, heads=4, context=CONTEXT,
                           vocab=VOCAB, api=api, rngs=rngs)
    x = jax.random.randint(jax.random.key(3), (R * M * MB, CONTEXT), 0, VOCAB)
    y = jnp.roll(x, -1, axis=1)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MB], targets=y[:MB],
                       stages=K, microbatches=M, schedule=schedule,
                       mesh=pj.make_mesh(K, R, fsdp=F, tensor=T))
    return layers, pipe, (x, y)


CASES = [(2, 1, 2, 2, "linen"), (2, 1, 1, 2, "linen"), (2, 2, 1, 2, "linen"),
         (4, 1, 2, 1, "linen"), (2, 1, 1, 4, "linen"), (2, 1, 2, 2, "nnx")]


@pytest.mark.parametrize("K, R, F, T, api", fast_and_slow(CASES, fast=[CASES[0]]))
def test_the_zoo_gpt_split_over_tensor_equals_the_sequential_model(K, R, F, T, api):
    layers, pipe, (x, y) = _gpt(K, R, F, T, api=api)
    params = pipe.init(jax.random.key(0))
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = sequential_value_and_grad(layers, R * M, pj.losses.next_token)(
        pj.unstage(params), x, y, jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


def _trained(K, R, F, T, schedule):
    _, pipe, data = _gpt(K, R, F, T, schedule)
    # eps = 1e-3: Adam's first step turns a gradient's rounding into lr·Δg/eps
    trainer = pipe.trainer(optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))
    state, m = trainer.step(trainer.init(pipe.init(jax.random.key(0))), data)
    losses = [m["losses"]]
    if pipe.schedule.asynchronous:
        state, flushed = trainer.flush(state)
        losses.append(flushed["losses"])
    return np.concatenate(losses), state, trainer


@pytest.mark.parametrize("K, R, F, T, schedule", fast_and_slow(
    [(2, 1, 2, 2, "pb"), (2, 2, 1, 2, "pb"), (2, 1, 2, 2, "1f1b")], fast=[(2, 1, 2, 2, "1f1b")]))
def test_a_trainer_split_over_tensor_equals_the_same_schedule_unsplit(K, R, F, T, schedule):
    (base, whole, trainer), (losses, split, split_trainer) = (
        _trained(K, R, f, t, schedule) for f, t in ((1, 1), (F, T)))
    done = np.isfinite(base)
    np.testing.assert_array_equal(np.isfinite(losses), done)
    assert rel_err(losses[done], base[done]) < 1e-5
    assert rel_err(pj.unstage(split), pj.unstage(whole)) < 1e-5
    assert rel_err(split_trainer.opt_state(split), trainer.opt_state(whole)) < 1e-5


def _compiled(F, T):
    _, pipe, data = _gpt(2, F=F, T=T, width=64)
    trainer = pipe.trainer(optax.adamw(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    return pipe, trainer, trainer.step.lower(state, data).compile()


@pytest.mark.slow  # the HLO of a split step; its equality runs fast
def test_a_step_split_over_tensor_gathers_no_weight():
    pipe, trainer, compiled = _compiled(1, 2)
    gathers = hlo.per_tick(compiled.as_text(), pipe.schedule.ticks, "all-gather")
    assert gathers == {"tick": 0, "step": 0}
    reduces = hlo.per_tick(compiled.as_text(), pipe.schedule.ticks, "all-reduce")
    assert reduces["tick"] > 0  # Megatron's all-reduces, inserted by XLA


@pytest.mark.slow
def test_fsdp_2_by_tensor_2_holds_a_quarter_of_the_arguments_as_predicted():
    """Argument bytes (parameters, AdamW's state, the batch) of the compiled
    step against fsdp = tensor = 1; `trainer.memory()` as close to the
    compiled peak (arguments, outputs not aliased to them, temporaries) as
    unsplit (benchmarks/planner.py --part memory measures both at a larger
    size)."""
    def measured(F, T):
        _, trainer, compiled = _compiled(F, T)
        return compiled.memory_analysis().argument_size_in_bytes, \
            trainer.memory().total / peak_bytes(compiled)

    (whole, predicted_whole), (quarter, predicted) = measured(1, 1), measured(2, 2)
    assert quarter / whole <= 0.30
    assert abs(predicted - 1) < 0.1 and abs(predicted - predicted_whole) < 0.05


def test_the_kept_ring_holds_a_devices_heads_and_hidden_units_alone():
    """remat "none" at tensor 2: the residuals XLA computes split over
    `tensor` (an attention's heads, the MLP's hidden units) are kept split,
    so a device's kept ring is smaller than unsplit; the residual stream's
    stay whole."""
    def kept(T):
        layers, _, (x, y) = _gpt(2)
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MB], targets=y[:MB],
                           stages=2, microbatches=M, remat="none",
                           mesh=pj.make_mesh(2, tensor=T))
        return pipe.layout.kept

    whole, split = kept(1), kept(2)
    assert any(split.tensor_slots) and not all(split.tensor_slots)
    assert split.slot_bytes() < 0.75 * whole.slot_bytes()


@pytest.mark.slow  # the kept ring's split runs fast; this compiles the step
def test_a_kept_ring_split_over_tensor_is_gathered_nowhere_and_predicted():
    """GPipe without remat at tensor 2 keeps M micro-batches' residuals: no
    all-gather in the step (a ring kept whole was gathered after the scan
    from a split shadow of it), and `trainer.memory()` within 5 % of the
    compiled peak."""
    layers, _, (x, y) = _gpt(2, width=64)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=x[:MB], targets=y[:MB],
                       stages=2, microbatches=M, schedule="gpipe", remat="none",
                       mesh=pj.make_mesh(2, tensor=2))
    trainer = pipe.trainer(optax.adamw(1e-3))
    compiled = trainer.step.lower(trainer.init(pipe.init(jax.random.key(0))), (x, y)).compile()
    assert hlo.per_tick(compiled.as_text(), pipe.schedule.ticks, "all-gather") == \
        {"tick": 0, "step": 0}
    assert abs(trainer.memory().total / peak_bytes(compiled) - 1) < 0.05


def _dense(names):
    return nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), names))


@pytest.mark.parametrize("names, words", [
    ((None, "model"), ["layer 1 (Dense)", "kernel", "'model'", "rename"]),
    (("tensor", "tensor"), ["layer 1 (Dense)", "kernel", "once"]),
    ((None, "tensor"), ["layer 1 (Dense)", "kernel", "tensor=3", "divide"])])
def test_a_bad_annotation_names_the_layer_the_variable_and_the_fix(names, words):
    layers = [nn.Dense(8), _dense(names), nn.Dense(3)]
    with pytest.raises(LayerError) as err:
        pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 5)), stages=1,
                    microbatches=1, mesh=pj.make_mesh(1, tensor=3 if "divide" in words else 2))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_logical_annotations_map_through_flax_rules(api):
    logical = ("embed", "mlp")
    if api == "linen":
        layer = nn.Dense(8, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), logical))
    else:
        with nnx.use_eager_sharding(False):
            layer = nnx.Linear(5, 8, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
                nnx.initializers.lecun_normal(), logical))
    layers = [layer, nn.relu, nn.Dense(3)]
    with nn.logical_axis_rules([("embed", None), ("mlp", "tensor")]):
        pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 5)),
                           stages=1, microbatches=1, mesh=pj.make_mesh(1, tensor=2))
    assert [s.tensor_axis for s in pipe.build.code.params.leaves[0]] == [None, 1, None, None]


def test_an_unknown_mesh_axis_lists_the_known_ones():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("stage", "model"))
    with pytest.raises(ConfigError, match="'tensor'"):
        pj.pipeline([nn.Dense(4), nn.Dense(3)], loss=pj.losses.cross_entropy,
                    example=jnp.zeros((4, 5)),
                    stages=2, microbatches=2, mesh=mesh)


@pytest.mark.slow  # across layouts at fsdp alone: tests/compile/test_fsdp.py
def test_a_checkpoint_of_4_stages_by_2_replicas_restores_onto_fsdp_by_tensor(tmp_path):
    """Saved at (stage 4, data 2), restored at (stage 2, fsdp 2, tensor 2)
    with micro-batches twice as large: the next step's loss (the mean over
    the same examples) is the unbroken run's."""
    def trainer(K, R, F, T, mb):
        layers = pj.models.gpt(depth=2, width=16, heads=4, context=CONTEXT, vocab=VOCAB)
        example = jnp.zeros((mb, CONTEXT), jnp.int32)
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=example, targets=example,
                           stages=K, microbatches=M, mesh=pj.make_mesh(K, R, fsdp=F, tensor=T))
        return pipe, pipe.trainer(optax.adam(1e-2))

    def data(i):
        x = jax.random.randint(jax.random.key(i), (2 * M * MB, CONTEXT), 0, VOCAB)
        return x, jnp.roll(x, -1, axis=1)

    pipe, saved = trainer(4, 2, 1, 1, MB)
    state = saved.init(pipe.init(jax.random.key(0)))
    state, _ = saved.step(state, data(0))
    pj.save(tmp_path, saved, state)
    _, want = saved.step(state, data(1))
    _, other = trainer(2, 1, 2, 2, 2 * MB)
    _, got = other.step(pj.restore(tmp_path, other), data(1))
    assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-5 * abs(float(want["loss"]))


def test_a_tensor_axis_without_an_annotated_layer_is_an_error():
    with pytest.raises(ConfigError, match="no layer annotates"):
        pj.pipeline([nn.Dense(4), nn.Dense(3)], loss=pj.losses.cross_entropy,
                    example=jnp.zeros((4, 5)), stages=2, microbatches=2,
                    mesh=pj.make_mesh(2, tensor=2))


def test_nnx_layers_built_on_an_explicit_mesh_split_as_annotated():
    """Modules made under `jax.set_mesh` of `jax.make_mesh`'s Explicit axes
    arrive sharded; a bias left whole after a split matrix (its gradient
    computed split) packs without moving data between devices (a hang on
    CPU inside a stage's branch, once)."""
    mesh = jax.make_mesh((2, 2), ("stage", "tensor"))
    init = nnx.initializers.lecun_normal()
    col, row = (nnx.with_partitioning(init, names)
                for names in ((None, "tensor"), ("tensor", None)))
    with jax.set_mesh(mesh):
        r = nnx.Rngs(0)
        layers = [nnx.Linear(8, 16, kernel_init=col, rngs=r), jax.nn.relu,
                  nnx.Linear(16, 8, kernel_init=row, rngs=r), nnx.Linear(8, 16, kernel_init=col,
                                                                        rngs=r),
                  jax.nn.relu, nnx.Linear(16, 3, kernel_init=row, rngs=r)]
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 8)),
                       stages=2, microbatches=2, mesh=mesh)
    params = pipe.init(jax.random.key(0))
    x, y = jax.random.normal(jax.random.key(1), (8, 8)), jnp.arange(8) % 3
    loss, grads = pipe.value_and_grad(params, (x, y))
    ref_loss, ref_grads = sequential_value_and_grad(layers, 2)(pj.unstage(params), x, y,
                                                               jax.random.key(0))
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(pj.unstage(grads), ref_grads) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("settings, tolerance", [
    ({"remat": "none"}, 1e-5), ({"compute_dtype": jnp.bfloat16}, 2e-2),
    ({"schedule": "zb-h1"}, 1e-5), ({"schedule": "gpipe", "fsdp_gather": "step"}, 1e-5),
    ({"schedule": "pipedream", "weight_stashing": True}, 1e-5)])
def test_remat_bf16_zero_bubble_and_stashing_split_as_unsplit(settings, tolerance):
    """Two steps of momentum SGD at fsdp 2 x tensor 2 against fsdp = tensor
    = 1 (bf16: the tolerance of tests/compile/test_precision.py)."""
    layers, _, data = _gpt(2)
    runs = []
    for F, T in ((1, 1), (2, 2)):
        pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=data[0][:MB],
                           targets=data[1][:MB], stages=2, microbatches=M,
                           mesh=pj.make_mesh(2, fsdp=F, tensor=T),
                           **{"schedule": "1f1b", **settings})
        trainer = pipe.trainer(optax.sgd(0.05, momentum=0.9))
        state = trainer.init(pipe.init(jax.random.key(0)))
        losses = []
        for _ in range(2):
            state, m = trainer.step(state, data)
            losses.append(m["losses"])
        runs.append((np.concatenate(losses), pj.unstage(state)))
    (a, whole), (b, split) = runs
    done = np.isfinite(a)
    assert rel_err(b[done], a[done]) < tolerance / 10
    assert rel_err(split, whole) < tolerance
