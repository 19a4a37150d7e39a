"""pj.simulate: delayed-gradient training on one device against plain loops."""

import jax
import jax.numpy as jnp
import optax
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.reference import batch, rel_err

LAYERS = pj.models.mlp(3, 16, 10)
LOSS = pj.losses.cross_entropy


def _data(n=12, mb=4):
    x, y = batch(n * mb)
    return x.reshape(n, mb, 20), y.reshape(n, mb)


def _delayed_loop(variables, opt, xs, ys, D):
    """g_t = ∇L(w_{t−D}) (consistent), applied to the master weights."""
    grad = jax.jit(jax.value_and_grad(lambda v, x, y: LOSS(pj.apply_layers(LAYERS, v, x), y)))
    history, state, losses = [variables], opt.init(variables), []
    for x, y in zip(xs, ys):
        loss, g = grad(history[max(0, len(history) - 1 - D)], x, y)
        u, state = opt.update(g, state, history[-1])
        history.append(optax.apply_updates(history[-1], u))
        losses.append(loss)
    return history[-1], jnp.stack(losses)


@pytest.mark.parametrize("D", [0, 3])
def test_constant_delay_equals_a_loop_over_weight_versions(D):
    variables = pj.unstage(pj.pipeline(LAYERS, loss=LOSS, example=jnp.zeros((4, 20)), stages=1,
                                       microbatches=1).init(jax.random.key(0)))
    xs, ys = _data()
    opt = optax.sgd(0.1, momentum=0.9)
    ref, ref_losses = _delayed_loop(variables, opt, xs, ys, D)
    for split in (1, 3):  # one stage, or three stages with the same delay
        sim = pj.simulate(LAYERS, loss=LOSS, optimizer=opt, split=split, delays=D, consistent=True)
        state, losses = sim.run(sim.init(variables), xs, ys)
        assert rel_err(sim.params(state), ref) < 1e-5
        assert rel_err(losses, ref_losses) < 1e-5
        assert int(state.step) == len(xs)


def test_variables_are_the_pipelines_initial_ones():
    sim = pj.simulate(LAYERS, loss=LOSS, optimizer=optax.sgd(0.1), split=2)
    pipe = pj.pipeline(LAYERS, loss=LOSS, example=jnp.zeros((4, 20)), stages=2, microbatches=1)
    assert rel_err(sim.variables(jax.random.key(3), jnp.zeros((4, 20))),
                   pj.unstage(pipe.init(jax.random.key(3)))) == 0


def test_stage_infos_and_splits():
    sim = pj.simulate(LAYERS, loss=LOSS, optimizer=lambda s: optax.sgd(0.1), split=[2, 2, 2, 1],
                      delays="pb")
    assert sim.delays == [6, 4, 2, 0]
    assert pj.simulate(LAYERS, loss=LOSS, optimizer=optax.sgd(0.1), split=4,
                       delays="pipedream").delays == [3, 2, 1, 0]
    assert [len(r) for r in pj.simulate(LAYERS, loss=LOSS, optimizer=optax.sgd(0.1), split=3,
                                        delays=[1, 1, 0]).ranges] == [3, 2, 2]


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="covers 4 layers but the list has 7"):
        pj.simulate(LAYERS, loss=LOSS, optimizer=optax.sgd(0.1), split=[2, 2])
    with pytest.raises(ConfigError, match="one per stage"):
        pj.simulate(LAYERS, loss=LOSS, optimizer=optax.sgd(0.1), split=2, delays=[1, 2, 3])
    with pytest.raises(pj.errors.ArgumentTypeError, match="optax"):
        pj.simulate(LAYERS, loss=LOSS, optimizer=0.1, split=2)


def test_sweepable_mitigations_equal_the_named_ones():
    """mitigation(sweep=True): one chain with its numbers in the state gives
    the named chains' training, under a decaying rate."""
    rate = optax.piecewise_constant_schedule(0.05, {6: 0.1})
    xs, ys = _data(n=16)
    for name in ("spectrain", "lwp+sc"):  # a backward horizon; spike compensation and LWP
        runs = []
        for sweep in (False, True):
            mit = pj.transforms.mitigation(name, rate, momentum=0.9, sweep=sweep)
            sim = pj.simulate(LAYERS, loss=LOSS, optimizer=mit.optimizer, split=3,
                              delays="pipedream", consistent=mit.weight_stashing)
            state, losses = sim.run(sim.init(sim.variables(jax.random.key(0), xs[0])), xs, ys)
            runs.append((sim.params(state), losses))
        assert rel_err(runs[0], runs[1]) < 1e-6, name


def _adamw_lm_run(mit: "pj.transforms.Mitigation", K=4, M=2, MB=2, T=8, steps=25):
    """A small GPT pipelined with PB at K stages over steps·M micro-batches
    (one update each) and a flush; returns (pipe, initial, final params,
    each micro-batch's loss, xs, ys)."""
    layers = pj.models.gpt(depth=2, width=16, heads=2, context=T, vocab=32)
    pipe = pj.pipeline(layers, loss=pj.losses.next_token, example=jnp.zeros((MB, T), jnp.int32),
                       targets=jnp.zeros((MB, T), jnp.int32), stages=K, microbatches=M,
                       schedule="pb", weight_stashing=mit.weight_stashing)
    trainer = pipe.trainer(mit.optimizer)
    params = pipe.init(jax.random.key(1))
    state, losses = trainer.init(params, jax.random.key(9)), {}
    tokens = jax.random.randint(jax.random.key(2), (steps, M * MB, T + 1), 0, 32)
    for s in range(steps):
        state, metrics = trainer.step(state, (tokens[s, :, :-1], tokens[s, :, 1:]))
        losses.update(zip(metrics["microbatch"].tolist(), metrics["losses"].tolist()))
    state, metrics = trainer.flush(state)
    losses.update(zip(metrics["microbatch"].tolist(), metrics["losses"].tolist()))
    xs = tokens[..., :-1].reshape(steps * M, MB, T)
    ys = tokens[..., 1:].reshape(steps * M, MB, T)
    return pipe, params, state.params, jnp.array([losses[g] for g in range(steps * M)]), xs, ys


ADAMW = pj.transforms.AdamW(b2=0.95, weight_decay=0.1,
                            mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p))


@pytest.mark.slow  # on an MLP: test_pb_with_each_mitigation_equals_the_versioned_reference_and_simulate
@pytest.mark.parametrize("name", ["none", "lwp+sc", "pipeoptim", "nesterov"])
def test_simulate_equals_the_pb_trainer_with_adamw_on_a_language_model(name):
    """50 updates of PB at K = 4 with AdamW (warm-up and cosine decay) on a
    GPT: the simulator's losses and weights are the trainer's."""
    rate = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 5, 60)
    mit = pj.transforms.mitigation(name, rate, optimizer=ADAMW)
    pipe, initial, final, losses, xs, ys = _adamw_lm_run(mit)
    sim = pj.simulate(pipe.layers, loss=pj.losses.next_token, optimizer=mit.optimizer,
                      split=pipe.plan.split, delays=pipe.schedule, consistent=mit.weight_stashing)
    assert sim.delays == [6, 4, 2, 0]
    state, sim_losses = sim.run(sim.init(pj.unstage(initial), jax.random.key(9)), xs, ys)
    assert int(state.step) == 50
    assert rel_err(sim_losses, losses) < 1e-5
    assert rel_err(sim.params(state), pj.unstage(final)) < 1e-5
    # not vacuous: without the delays the same updates train differently
    undelayed = pj.simulate(pipe.layers, loss=pj.losses.next_token, optimizer=mit.optimizer,
                            split=pipe.plan.split, delays=0)
    _, plain = undelayed.run(undelayed.init(pj.unstage(initial)), xs, ys)
    assert rel_err(plain, losses) > 1e-4
