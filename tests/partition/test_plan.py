"""The plan table: layers, costs, bytes and padding per stage."""

import flax.linen as nn
import jax.numpy as jnp

import pipejax as pj
from pipejax.partition import make_plan


def test_plan_of_identical_stages_has_no_padding():
    specs = pj.trace(pj.models.mlp(3, 32, 32)[:-1], jnp.zeros((2, 32)))  # [Dense, relu] x 3
    plan = make_plan(specs, 3, "variance")
    assert plan.split == (2, 2, 2)
    assert plan.padding_overhead == 0.0
    assert plan.param_bytes == [(32 * 32 + 32) * 4] * 3


def test_plan_table_names_layers_costs_and_bytes():
    specs = pj.trace([nn.Dense(64), nn.relu, nn.Dense(8), jnp.tanh, nn.Dense(10)], jnp.zeros((4, 20)))
    plan = make_plan(specs, 2, "variance")
    text = str(plan)
    for word in ("stage", "layers", "cost", "params", "sends", "padding", "Dense", "relu"):
        assert word in text
    assert sum(plan.split) == 5 and len(plan.ranges) == 2
    assert plan.boundary_bytes[0] == specs[plan.split[0] - 1].activation_bytes
    assert plan.padded_param_bytes >= sum(plan.param_bytes)
    assert plan.costs[0] + plan.costs[1] == sum(s.cost for s in specs)
