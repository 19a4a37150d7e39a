"""Tables written by torch.distributed.pipelining (tests/schedules/torch_tables,
torch 2.13.0) load with their placement, pipejax's own V and interleaved
tables are torch's, `to_csv` round-trips, and a bad table names the rank
and the action at fault."""

import pathlib

import numpy as np
import pytest

import pipejax as pj
from pipejax.errors import ScheduleError
from pipejax.placement import Placement
from pipejax.schedules import make_schedule

TABLES = pathlib.Path(__file__).parent / "torch_tables"
# torch 2.13's Schedule1F1B writes its last rank's forwards as micro-batches 1..M (its own
# loader rejects them too): test_torch_1f1b_tables_are_rejected.
GOOD = sorted(p for p in TABLES.glob("*.csv") if not p.name.startswith("Schedule1F1B"))


def _microbatches(path: pathlib.Path) -> int:
    return int(path.stem.rsplit("_M", 1)[1])


def tasks(schedule: pj.Schedule) -> set:
    """Every (tick, device, op, micro-batch, local chunk) the table runs, lanes aside."""
    t, k, lane = np.nonzero(schedule.ops)
    return {(a, b, *map(int, schedule.table[a, b, c])) for a, b, c in zip(t, k, lane)}


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_torch_tables_load_with_their_placement(path):
    M = _microbatches(path)
    s = pj.Schedule.from_csv(path, microbatches=M)
    K = int(path.stem.split("_K")[1].split("_")[0])
    single = path.stem.startswith("ScheduleGPipe")
    kind = "v" if "ZBV" in path.stem or "DualPipeV" in path.stem else "loop"
    assert s.placement == Placement(K, 1 if single else 2, "loop" if single else kind)
    assert s.name == path.stem and s.synchronous
    assert tasks(pj.Schedule.from_csv(s.to_csv(), microbatches=M)) == tasks(s)


@pytest.mark.parametrize("K,M", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_named_tables_are_torchs(K, M):
    load = lambda name: pj.Schedule.from_csv(TABLES / f"Schedule{name}_K{K}_M{M}.csv", M)
    assert np.array_equal(pj.schedules.zb_v(K, M).table, load("ZBVZeroBubble").table)
    if M >= 2 * K:  # torch's DualPipeV takes M >= 2K
        assert np.array_equal(pj.schedules.dualpipev(K, M).table, load("DualPipeV").table)
    assert np.array_equal(make_schedule("interleaved", Placement(K, 2), M).table,
                          load("Interleaved1F1B").table)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 2),
                                    ("gpipe", 2), ("zb-v", 2), ("dualpipev", 2)])
def test_to_csv_round_trips(name, v, tmp_path):
    kind = "v" if name in ("zb-v", "dualpipev") else "loop"
    s = make_schedule(name, Placement(4, v, kind), 8)
    assert_round_trips(s, tmp_path)


def test_a_fused_pair_is_written_as_two_slots(tmp_path):
    s = make_schedule("1f1b", Placement(1), 2)  # K = 1: every tick fuses F and BW
    assert s.to_csv().splitlines() == ["0F0,0B0,0F1,0B1"]
    back = pj.Schedule.from_csv(s.to_csv(), microbatches=2)
    assert back.ticks == 4 and not back.fused.any()  # the BW waits a tick for its F


def assert_round_trips(s: pj.Schedule, tmp_path) -> None:
    path = tmp_path / "table.csv"
    text = s.to_csv(path)
    assert path.read_bytes().decode() == text and len(text.splitlines()) == 4
    back = pj.Schedule.from_csv(path, microbatches=8)
    assert back.placement == s.placement and tasks(back) == tasks(s)


def test_overlapped_pairs_are_written_as_torch_writes_them():
    text = pj.schedules.dualpipev(2, 4).to_csv()
    assert "(0F3;3B1)OVERLAP_F_B" in text.splitlines()[0]


def test_torch_1f1b_tables_are_rejected():
    with pytest.raises(ScheduleError, match=r"rank 1: action 1F4 names micro-batch 4 outside"):
        pj.Schedule.from_csv(TABLES / "Schedule1F1B_K2_M4.csv", microbatches=4)


GPIPE = "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n"


@pytest.mark.parametrize("text,match", [
    ("0F0,0F0,0B0\n1F0,1B0\n", "rank 0: action 0F0 appears twice"),
    ("0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n", "rank 0: the backward of stage 0, micro-batch 1, is missing"),
    ("0F0,0W0,0I0\n1F0,1B0\n", "rank 0: action 0W0 \\(W\\) comes before its input gradient 0I0"),
    ("0F0,0I0\n1F0,1B0\n", "micro-batch 0, runs it as 0I0; give either 0B0 or 0I0 then 0W0"),
    ("0F0,1F0,0B0\n1B0\n", "rank 1: action 1B0 runs stage 1, which rank 0 runs too"),
    ("0F0,0X0\n", "rank 0: cannot read action '0X0'"),
    ("1F0,1B0\n0F0,0B0\n2F0,2B0\n3F0,3B0\n", "neither the loop"),
    ("0F0,0B0,0F1,0B1\n1B0,1F0,1F1,1B1\n", "stalls at tick 1: device 0 waits to run 0B0"),
])
def test_bad_tables_name_the_rank_and_the_action(text, match):
    M = 1 if text.count("F1") == 0 else 2
    with pytest.raises(ScheduleError, match=match):
        pj.Schedule.from_csv(text, microbatches=M)


def test_a_table_of_other_ranks_than_stages_is_named():
    table = pj.Schedule.from_csv(GPIPE, microbatches=2)
    with pytest.raises(ScheduleError, match=r"built for stages=2 \(the pipeline's 4\)"):
        pj.pipeline([lambda x: x] * 4, loss=lambda o, t: o.mean(), example=np.zeros((2, 3)),
                    stages=4, microbatches=2, schedule=table)


def test_a_table_brings_its_placement_and_the_pipeline_says_what_differs():
    table = pj.Schedule.from_csv(TABLES / "ScheduleDualPipeV_K2_M4.csv", microbatches=4)
    pipe = lambda **kw: pj.pipeline([lambda x: x] * 4, loss=lambda o, t: o.mean(),
                                    example=np.zeros((2, 3)), stages=2, microbatches=4,
                                    schedule=table, **kw)
    assert pipe().plan.placement == Placement(2, 2, "v")
    with pytest.raises(ScheduleError, match=r"placement='v' \(the pipeline's 'loop'\); .*leave "
                                            "virtual and placement out"):
        pipe(placement="loop")


def test_odd_but_valid_csv_reads_and_bad_overlaps_are_named(tmp_path):
    path = tmp_path / "gpipe.csv"
    path.write_bytes(b"\xef\xbb\xbf\r\n0F0, 0F1 ,,0SEND_F1,0B0,\"0B1\"\r\n\r\n1F0,1F1,1B0,1B1,,\r\n")
    s = pj.Schedule.from_csv(path, microbatches=2)  # a byte-order mark, blank lines, comms
    assert s.name == "gpipe" and tasks(s) == tasks(pj.Schedule.from_csv(GPIPE, microbatches=2))
    assert pj.Schedule.from_csv(GPIPE, microbatches=2).name == "csv"
    for cell in ("(1F0;1F1)OVERLAP_F_B", "(1B0;1W0)OVERLAP_F_B", "(1F0;1B0;1W0)OVERLAP_F_B"):
        with pytest.raises(ScheduleError, match="rank 1: .* an OVERLAP_F_B pairs one forward"):
            pj.Schedule.from_csv(f"0F0,0F1,0B0,0B1\n{cell},1F1,1B1\n", microbatches=2)


def test_asynchronous_tables_and_other_formats_are_refused():
    with pytest.raises(ScheduleError, match="asynchronous"):
        make_schedule("pb", Placement(2), 2).to_csv()
    with pytest.raises(ScheduleError, match="format='torch'"):
        pj.Schedule.from_csv(GPIPE, microbatches=2, format="jaxpp")
