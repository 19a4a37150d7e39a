"""`max_padding`: the partitioner's best split among those padded at most that much."""

import flax.linen as nn
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.partition import objective_value
from pipejax.partition.padding import splits, padding

K = 3


def _layers():
    # Dense layers of uneven widths: the balanced split pads its slots to the widest.
    return [nn.Dense(96), nn.relu, nn.Dense(8), nn.Dense(96), nn.relu, nn.Dense(8),
            nn.Dense(64), nn.relu, nn.Dense(10)]


def _pipe(**kw):
    return pj.pipeline(_layers(), loss=pj.losses.cross_entropy, example=jnp.zeros((4, 16)),
                       stages=K, microbatches=2, **kw)


def test_max_padding_picks_the_best_balanced_split_within_the_bound():
    balanced = _pipe()
    specs, costs = balanced.specs, [s.cost for s in balanced.specs]
    tried = {split: padding(specs, split) for split in splits(len(specs), K)}
    least = min(tried.values())
    assert tried[balanced.plan.split] > least + 0.05  # the bound has work to do
    bound = (least + tried[balanced.plan.split]) / 2
    pipe = _pipe(max_padding=bound)
    assert pipe.layout.padding_overhead <= bound
    within = [s for s, pad in tried.items() if pad <= bound]
    best = min(objective_value(costs, s, "variance") for s in within)
    assert objective_value(costs, pipe.plan.split, "variance") == pytest.approx(best)
    assert pipe.layout.padding_overhead == pytest.approx(tried[pipe.plan.split])


def test_an_unreachable_padding_says_which_layer_forces_it():
    with pytest.raises(pj.errors.ConfigError, match="largest layer holds"):
        _pipe(max_padding=0.0)


@pytest.mark.parametrize("kw,match", [
    ({"max_padding": 0.5, "partition": [3, 3, 3]}, "explicit partition"),
    ({"max_padding": 0.5, "max_bytes": 1e9}, "not both"),
    ({"max_padding": -1}, "fraction >= 0")])
def test_max_padding_settings_that_cannot_hold(kw, match):
    with pytest.raises(pj.errors.ConfigError, match=match):
        _pipe(**kw)
