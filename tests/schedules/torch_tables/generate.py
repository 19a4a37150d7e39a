"""Regenerate the PyTorch reference schedule tables in this folder.

Run with a Python that has torch installed (NOT a pipejax dependency), e.g.:

    python -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch
    /tmp/torchenv/bin/python tests/schedules/torch_tables/generate.py

For each schedule class of torch.distributed.pipelining.schedules and each
K (ranks) in {2, 4}, M (microbatches) in {K, 2K}, this builds the schedule
with mock stage objects (no process group is needed: every schedule computes
the action order of *all* ranks in its constructor) and writes
``{class}_K{K}_M{M}.csv`` with torch's own ``_dump_csv(format="compute_only")``
writer.  Every file is then read back with torch's own
``_PipelineScheduleRuntime._load_csv(format="compute_only")`` (which parses it,
validates it with ``_validate_schedule`` and lowers it to send/recv actions)
and compared with the in-memory order.

Placement: GPipe / 1F1B use one stage per rank (K stages); the multi-stage
classes use 2 stages per rank (2K stages), loop placement (rank r holds r and
r + K) for Interleaved1F1B / LoopedBFS / InterleavedZeroBubble and V placement
(rank r holds r and 2K - 1 - r) for ZBVZeroBubble / DualPipeV.

Single-stage schedules (GPipe, 1F1B): torch's ``_get_pipeline_order`` passes
its result through ``_add_reduce_grad``, which drops the ``None`` bubbles and
appends a ``{stage}REDUCE_GRAD`` action after each stage's last backward.
Those REDUCE_GRAD actions are not compute actions (the compute_only loader
rejects them), so they are filtered out before writing; the rows of those two
classes therefore carry no bubbles (no empty cells).
"""

from __future__ import annotations

import datetime
import os
import sys
import types

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase

HERE = os.path.dirname(os.path.abspath(__file__))

CLASSES = [
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
]
SINGLE = {"ScheduleGPipe", "Schedule1F1B"}
V_STYLE = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
STAGES_PER_RANK = 2


class MockStage(_PipelineStageBase):
    """Stage stand-in, as in torch's test/distributed/pipelining/test_schedule.py:
    only the attributes the schedule constructors read, no process group."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.group = None
        self.submod = None
        self.stage_index_to_group_rank = {i: i % group_size for i in range(num_stages)}

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        raise NotImplementedError("mock stage: schedule tables only")

    def _prepare_backward_infra(self, *args, **kwargs):
        raise NotImplementedError("mock stage: schedule tables only")


class Refused(Exception):
    pass


def rank0_stages(name: str, K: int):
    if name in SINGLE:
        return MockStage(0, K, K, 0)
    n = STAGES_PER_RANK * K
    idx = [0, n - 1] if name in V_STYLE else [0, K]
    return [MockStage(i, n, K, 0) for i in idx]


def compute_only(order):
    return {
        r: [a for a in acts if a is None or a.is_compute_op] for r, acts in order.items()
    }


def write(name: str, K: int, M: int, path: str):
    cls = getattr(S, name)
    stages = rank0_stages(name, K)  # errors here are bugs, not refusals
    try:
        sched = cls(stages, M)
    except (ValueError, AssertionError, RuntimeError) as e:  # class refuses (K, M)
        raise Refused(f"{type(e).__name__}: {str(e).strip().splitlines()[0]}") from e
    if name in SINGLE:
        # PipelineScheduleSingle has no _dump_csv; use torch's writer on the
        # compute-only part of its pipeline_order (see module docstring).
        holder = types.SimpleNamespace(pipeline_order=compute_only(sched.pipeline_order))
        S._PipelineScheduleRuntime._dump_csv(holder, path, format="compute_only")
        return holder.pipeline_order, K
    sched._dump_csv(path, format="compute_only")
    return sched.pipeline_order, STAGES_PER_RANK * K


def round_trip(path: str, K: int, n_stages: int, M: int, expected):
    """Read `path` back with torch's loader; return (stage->rank map or None, problem or None)."""
    local = [MockStage(0, n_stages, K, 0)]
    loader = S._PipelineScheduleRuntime(local, M)
    problem = None
    try:
        loader._load_csv(path, format="compute_only")
    except AssertionError as e:
        # torch's _validate_schedule rejected the table torch itself produced;
        # still check that the text parses back to the same actions.
        problem = str(e).strip().splitlines()[0]
    got = loader.pipeline_order
    if set(got) != set(expected):
        raise AssertionError(f"{path}: ranks {sorted(got)} != {sorted(expected)}")
    for r in expected:
        if list(got[r]) != list(expected[r]):
            raise AssertionError(f"{path}: rank {r} differs after round trip")
    return (None if problem else loader.stage_index_to_group_rank), problem


def main() -> int:
    written, skipped, invalid = [], [], []
    for name in CLASSES:
        if not hasattr(S, name):
            skipped.append(f"{name}: not in torch {torch.__version__}")
            continue
        for K in (2, 4):
            for M in (K, 2 * K):
                fname = f"{name}_K{K}_M{M}.csv"
                path = os.path.join(HERE, fname)
                try:
                    expected, n_stages = write(name, K, M, path)
                except Refused as e:
                    if os.path.exists(path):
                        os.remove(path)
                    skipped.append(f"{fname}: {e}")
                    continue
                s2r, problem = round_trip(path, K, n_stages, M, expected)
                written.append(fname)
                if problem:
                    invalid.append(f"{fname}: {problem}")
                    print(f"wrote {fname}  (parses back identically, but torch's "
                          f"_load_csv/_validate_schedule REJECTS it: {problem})")
                else:
                    print(f"wrote {fname}  (round trip OK, stage->rank {dict(sorted(s2r.items()))})")
    for s in skipped:
        print(f"skipped {s}")
    with open(os.path.join(HERE, "VERSION"), "w") as f:
        f.write(f"torch {torch.__version__}\n")
        f.write(f"generated {datetime.date.today().isoformat()}\n")
    print(f"{len(written)} files written ({len(invalid)} of them rejected by "
          f"torch's own validator), {len(skipped)} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
