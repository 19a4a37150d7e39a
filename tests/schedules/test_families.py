"""Schedule families: one registry says what a name means; a user registers their own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pipejax as pj
from pipejax.schedules import FAMILIES

M, MB = 4, 2
LAYERS = pj.models.mlp(depth=3, width=16, classes=10)


@pytest.fixture
def mine():
    """GPipe registered again as "mine", removed afterwards."""
    family = pj.schedules.register(dataclasses.replace(FAMILIES["gpipe"], name="mine"))
    yield family
    pj.schedules.unregister("mine")


def _pipe(schedule, K=2):
    return pj.pipeline(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                       stages=K, microbatches=M, schedule=schedule)


def test_every_family_builds_tables_as_it_says():
    for name, family in FAMILIES.items():
        placement = pj.schedules.placement_for(name, 2, None, None)
        assert (placement.kind, placement.virtual) == (family.placement, family.virtual)
        table = pj.schedules.make_schedule(name, placement, 4)
        assert table.name == name and table.asynchronous == family.asynchronous
        # an asynchronous family names a recipe for its staleness, a synchronous one none
        assert family.mitigation in (pj.transforms.MITIGATIONS if family.asynchronous else (None,))


def test_the_planner_advises_each_family_its_own_recipe():
    """2BW's one-step delay takes error feedback; the delays that grow with depth LWP + SC."""
    from pipejax.staleness import advise

    assert FAMILIES["2bw"].mitigation == "ef" and FAMILIES["pb"].mitigation == "lwp+sc"
    assert advise(0.1, 8, None, FAMILIES["2bw"].mitigation).endswith("mitigation('ef')")


@pytest.mark.slow  # trains a registered copy of GPipe; the refusals run fast
def test_a_registered_family_trains_by_its_name_as_the_one_it_copies(tmp_path, mine):
    x = jax.random.normal(jax.random.key(3), (M * MB, 40))
    y = jnp.arange(M * MB) % 10
    theirs, ours = _pipe("gpipe"), _pipe("mine")
    assert ours.schedule.name == "mine"
    np.testing.assert_array_equal(ours.schedule.table, theirs.schedule.table)
    params = theirs.init(jax.random.key(0))
    g_theirs = pj.unstage(theirs.value_and_grad(params, (x, y), jax.random.key(1))[1])
    g_ours = pj.unstage(ours.value_and_grad(ours.init(jax.random.key(0)), (x, y),
                                            jax.random.key(1))[1])
    jax.tree.map(np.testing.assert_array_equal, g_ours, g_theirs)
    trainer = ours.trainer(optax.adam(1e-2))
    state, _ = trainer.step(trainer.init(ours.init(jax.random.key(0))), (x, y))
    pj.save(tmp_path, trainer, state)
    again = pj.restore(tmp_path, trainer)
    jax.tree.map(np.testing.assert_array_equal, pj.unstage(again), pj.unstage(state))
    meta, _ = pj.checkpoint_files.read(tmp_path, None)
    assert meta["schedule"] == "mine"  # the name it was saved under
    plan = pj.planner.search(LAYERS, loss=pj.losses.cross_entropy, example=jnp.zeros(40),
                             machine=pj.planner.Machine(devices=2),
                             training=pj.planner.Training(batch=8),
                             space=pj.planner.Space(schedules=["mine"], stages=[2]))
    assert {c.schedule for c in plan} == {"mine"}


def test_a_family_is_refused_what_it_does_not_run():
    with pytest.raises(pj.errors.ConfigError, match=r"'1f1b' does not run virtual=2: 1F1B over "
                                                    r"virtual stages is 'interleaved'"):
        pj.schedules.make_schedule("1f1b", pj.Placement(2, 2), 4)
    with pytest.raises(pj.errors.ConfigError, match=r"'zb-v' runs on placement='v' with "
                                                    r"virtual=2, not on"):
        pj.schedules.make_schedule("zb-v", pj.Placement(2), 4)
    with pytest.raises(pj.errors.ConfigError, match="unknown schedule 'nope'"):
        _pipe("nope")
    with pytest.raises(pj.errors.ConfigError, match="register takes a pj.schedules.Family"):
        pj.schedules.register("gpipe")
    with pytest.raises(pj.errors.ConfigError, match="a family named 'gpipe' is registered"):
        pj.schedules.register(FAMILIES["gpipe"])
    with pytest.raises(pj.errors.ConfigError, match=r"virtual=2 is not one of the virtuals it "
                                                    r"runs, \(1,\)"):
        dataclasses.replace(FAMILIES["1f1b"], name="bad", virtual=2)
    with pytest.raises(pj.errors.ConfigError, match="does not end in .csv"):
        dataclasses.replace(FAMILIES["gpipe"], name="table.csv")


def test_a_family_whose_build_disagrees_with_it_is_an_error():
    liar = dataclasses.replace(FAMILIES["gpipe"], name="liar", asynchronous=True)
    with pytest.raises(pj.errors.ScheduleError, match="says asynchronous=True"):
        liar.table(2, 4, 1)
