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


def _route_of(p: Placement, j: int, step: int) -> tuple[int, int]:
    """The (source, destination) devices of chunk j's message to j + step,
    found among the placement's routes (a ppermute each: a permutation)."""
    pair = (p.device(j), p.device(j + step))
    found = [r for r in p.routes(step) if pair in r.pairs]
    assert len(found) == 1
    src, dst = zip(*found[0].pairs)
    assert len(set(src)) == len(src) == len(set(dst))
    assert all((d - s) % p.stages == found[0].shift for s, d in found[0].pairs)
    return pair


@pytest.mark.parametrize("K,v,kind", [(1, 1, "loop"), (3, 1, "loop"), (2, 2, "loop"),
                                      (4, 3, "loop"), (2, 2, "v"), (4, 2, "v"), (3, 4, "v")])
def test_maps_agree(K, v, kind):
    p = Placement(K, v, kind)
    assert p.chunks == K * v
    for j in range(K * v):
        k, c = p.device(j), p.local(j)
        assert c == j // K and p.chunk(k, c) == j
        if kind == "loop":
            assert k == j % K
        assert j in p.device_chunks(k) and list(p.device_chunks(k)).index(j) == c
        if j + 1 < K * v:  # where the message of chunk j is filed, computed by its sender
            assert p.next_local(j, k) == p.local(j + 1)
            _route_of(p, j, 1)
        if j > 0:
            assert p.previous_local(j, k) == p.local(j - 1)
            _route_of(p, j, -1)
    assert sorted(j for k in range(K) for j in p.device_chunks(k)) == list(range(K * v))
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
    with pytest.raises(ScheduleError, match=r"built for virtual=2 \(the pipeline's 1\)"):
        make_schedule(table, Placement(2), 4)


def test_the_build_checks_that_code_and_table_agree():
    layers = heterogeneous_layers()
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((4, 40)),
                       stages=2, microbatches=4, schedule="interleaved", virtual=2)
    b = pipe.build
    assert b.placement is b.code.placement and b.placement == b.schedule.placement
    other = make_schedule("gpipe", Placement(2), 4)
    with pytest.raises(ConfigError, match="schedule is made for Placement"):
        Build(b.placement, b.code, other, b.layout, b.mesh, b.stage)


def test_v_placement_folds_the_chunks_back():
    p = Placement(4, 2, "v")
    assert [list(p.device_chunks(k)) for k in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    shifts = {r.shift: r.pairs for r in p.routes(1)}  # down, the turn, up
    assert shifts == {1: [(0, 1), (1, 2), (2, 3)], 0: [(3, 3)], 3: [(1, 0), (2, 1), (3, 2)]}
    assert "V placement" in str(p)
    arrays = p.device(np.arange(8))  # the maps take arrays too
    assert arrays.tolist() == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("kwargs,match", [({"virtual": 1, "kind": "v"}, "virtual=2"),
                                          ({"virtual": 2, "kind": "zigzag"}, "'loop'")])
def test_bad_placement_is_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Placement(2, **kwargs)
