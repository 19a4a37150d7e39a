"""The stage layout as one value: its maps agree with each other and with
the circular placement's closed form, and a table or a stage code made for
another placement is a clear error."""

import jax.numpy as jnp
import numpy as np
import pytest

import pipejax as pj
from pipejax.compile.build import Build
from pipejax.errors import ConfigError, ScheduleError
from pipejax.placement import Placement
from pipejax.schedules import Schedule, make_schedule
from tests.reference import heterogeneous_layers


@pytest.mark.parametrize("K,v", [(1, 1), (3, 1), (2, 2), (4, 3)])
def test_maps_are_the_circular_placement(K, v):
    p = Placement(K, v)
    assert p.chunks == K * v
    for j in range(K * v):
        k, c = p.device(j), p.local(j)
        assert (k, c) == (j % K, j // K) and p.chunk(k, c) == j
        assert j in p.device_chunks(k) and list(p.device_chunks(k)).index(j) == c
        if j + 1 < K * v:  # where the message of chunk j is filed, computed by its sender
            assert p.next_local(j, k) == p.local(j + 1)
            assert (k, p.device(j + 1)) in p.forward_pairs() or K == 1
        if j > 0:
            assert p.previous_local(j, k) == p.local(j - 1)
    a = np.arange(K * v * 5).reshape(K * v, 5)  # [S, N] -> [K, N·v], column g·v + c
    per = p.per_device(a)
    assert per.shape == (K, 5 * v)
    assert all(per[k, g * v + c] == a[p.chunk(k, c), g]
               for k in range(K) for c in range(v) for g in range(5))


def test_maps_take_traced_values():
    p = Placement(4, 2)
    j = jnp.arange(8)
    assert (p.chunk(p.device(j), p.local(j)) == j).all()


def test_bad_counts_are_clear_errors():
    with pytest.raises(ConfigError, match="virtual=0"):
        Placement(2, 0)
    with pytest.raises(ConfigError, match="stages=1.5"):
        Placement(1.5)


def test_a_table_names_chunks_its_placement_holds():
    table = make_schedule("interleaved", Placement(2, 2), 4)
    assert table.placement == Placement(2, 2)
    with pytest.raises(ScheduleError, match=r"chunk 1 but its placement holds 1 .*Placement\(2, 2\)"):
        Schedule("mine", table.table, microbatches=4)
    with pytest.raises(ScheduleError, match="the table has 2 stages but its placement 3"):
        Schedule("mine", table.table, microbatches=4, placement=Placement(3, 2))
    with pytest.raises(ConfigError, match="virtual=2 but the pipeline has K=2, M=4, virtual=1"):
        make_schedule(table, Placement(2), 4)


def test_the_build_checks_that_code_and_table_agree():
    layers = heterogeneous_layers()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 40)),
                       stages=2, microbatches=4, schedule="interleaved", virtual=2)
    b = pipe.build
    assert b.placement is b.code.placement and b.placement == b.schedule.placement
    other = make_schedule("gpipe", Placement(2), 4)
    with pytest.raises(ConfigError, match="schedule is made for Placement"):
        Build(b.placement, b.code, other, b.layout, b.mesh)
