"""Tables written by torch's own schedule classes (tests/schedules/torch_tables)
train as the sequential model: `pj.pipeline` takes their placement and
virtual stages from the table. The V and interleaved tables equal pipejax's
own (tests/schedules/test_torch_csv.py), which tests/compile/test_v_placement.py
runs; `make test-all` runs the rest."""

import pathlib

import jax.numpy as jnp
import pytest

import pipejax as pj
from tests.cases import fast_and_slow
from tests.reference import assert_equals_sequential, heterogeneous_layers

TABLES = pathlib.Path(__file__).parents[1] / "schedules" / "torch_tables"
PATHS = sorted(p for p in TABLES.glob("*.csv") if not p.name.startswith("Schedule1F1B"))


@pytest.mark.parametrize("path", fast_and_slow(
    PATHS, fast=[TABLES / "ScheduleInterleavedZeroBubble_K2_M4.csv"], ids=lambda p: p.stem))
def test_torch_tables_train_as_the_sequential_model(path):
    K = int(path.stem.split("_K")[1].split("_")[0])
    M = int(path.stem.rsplit("_M", 1)[1])
    table = pj.Schedule.from_csv(path, microbatches=M)
    pipe = pj.pipeline(heterogeneous_layers(), loss=pj.losses.cross_entropy,
                       example=jnp.zeros((2, 20)), stages=K, microbatches=M, schedule=table)
    assert pipe.plan.placement == table.placement
    assert_equals_sequential(pipe)
