"""The plan table: layers, costs and bytes per stage; layers without a cost estimate."""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from pipejax.partition import make_plan
from pipejax.placement import Placement


def test_plan_of_identical_stages():
    specs = pj.trace(pj.models.mlp(3, 32, 32)[:-1], jnp.zeros((2, 32)))  # [Dense, relu] x 3
    plan = make_plan(specs, Placement(3), "variance")
    assert plan.split == (2, 2, 2)
    assert plan.param_bytes == [(32 * 32 + 32) * 4] * 3
    assert plan.costs[0] == plan.costs[1] == plan.costs[2]


def test_plan_table_names_layers_costs_and_bytes():
    specs = pj.trace([nn.Dense(64), nn.relu, nn.Dense(8), jnp.tanh, nn.Dense(10)], jnp.zeros((4, 20)))
    plan = make_plan(specs, Placement(2), "variance")
    text = str(plan)
    for word in ("stage", "layers", "cost", "params", "sends", "Dense", "relu"):
        assert word in text
    assert sum(plan.split) == 5 and len(plan.ranges) == 2
    assert plan.boundary_bytes[0] == specs[plan.split[0] - 1].activation_bytes
    assert plan.costs[0] + plan.costs[1] == sum(s.cost for s in specs)


def test_a_layer_without_a_cost_estimate_is_an_error_unless_split_by_hand():
    specs = pj.trace([nn.Dense(64), nn.relu, nn.Dense(8), jnp.tanh, nn.Dense(10)], jnp.zeros((4, 20)))
    specs[3] = dataclasses.replace(specs[3], flops=None)  # as when XLA gives no analysis
    with pytest.raises(ConfigError, match=r"no FLOP count for layers 3 \(tanh\).*cost='time'"):
        make_plan(specs, Placement(2), "variance")
    plan = make_plan(specs, Placement(2), [3, 2])
    assert plan.costs[0] is not None and plan.costs[1] is None
    assert "n/a" in str(plan) and "no cost estimate" in str(plan) and "3 (tanh)" in str(plan)
