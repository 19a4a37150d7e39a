"""The V placement on the one interpreter: zb-v and dualpipev (device k
holds chunks k and 2K − 1 − k; chunk K − 1 hands its output to chunk K on
its own device, and the last chunk sits on device 0) give the sequential
model's loss and gradients, unstage into layer order, and say where a
setting does not fit."""

import jax
import jax.numpy as jnp
import pytest

import pipejax as pj
from pipejax.errors import ConfigError
from tests.cases import fast_and_slow
from tests.reference import assert_equals_sequential, heterogeneous_layers, rel_err

MB = 2


def _pipe(schedule, K: int, M: int, **kw) -> pj.Pipeline:
    return pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((MB, 20)), stages=K, microbatches=M,
                       schedule=schedule, **kw)


@pytest.mark.parametrize("schedule,K,M", fast_and_slow(
    [(s, K, M) for s in ("zb-v", "dualpipev") for K, M in ((1, 2), (2, 2), (2, 4), (4, 4), (4, 8))],
    fast=[("dualpipev", 2, 4), ("zb-v", 1, 2)]))
def test_v_schedules_equal_sequential(schedule, K, M):
    pipe = _pipe(schedule, K, M)
    placement = pipe.plan.placement
    assert (placement.kind, placement.virtual) == ("v", 2)
    assert placement.device(2 * K - 1) == 0 and placement.device(K) == K - 1
    # At K = 1 both chunks sit on the one device: chunk 0's output is filed there.
    assert_equals_sequential(pipe)


def test_v_chunks_unstage_in_layer_order():
    pipe = _pipe("zb-v", 2, 2)
    plan = pipe.plan
    assert plan.device_layers(0) == [*plan.ranges[0], *plan.ranges[3]]
    values = pj.unstage(pipe.init(jax.random.key(0)))
    one = _pipe("gpipe", 1, 2)
    assert rel_err(values, pj.unstage(one.init(jax.random.key(0)))) == 0
    assert "V placement" in str(plan)


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "zb-v", "placement": "loop"}, "placement='v' with virtual=2"),
    ({"schedule": "gpipe", "virtual": 2, "placement": "v"}, "placement='loop'"),
    ({"schedule": "dualpipev", "virtual": 3}, "virtual=2"),
    ({"schedule": "1f1b", "placement": "v"}, "virtual=2")])
def test_v_settings_that_do_not_fit_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        _pipe(K=2, M=2, **kwargs)
