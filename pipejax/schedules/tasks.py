"""Typed schedule tasks: what one stage does in one lane of one tick.

A table entry is a `Task(op, microbatch, chunk)`, as JaxPP's task lists
name them (`Task(stage, microbatch, FWD|BWD|BWD_I|BWD_W)`): the op, the
micro-batch it runs (relative to the step's first), and the model chunk
of the device it runs: with v virtual stages per device, device k holds
local chunks c = 0..v−1, which the table's `Placement` maps to virtual
stages (pipejax/placement.py). A table holds them as one int array
`[ticks, stages, lanes, 3]`; within a tick the lanes run in order, then the
messages of the tick travel. The executor dispatches on the op.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

NONE = -(1 << 30)  # the micro-batch of an idle lane


class Op(enum.IntEnum):
    """What a task runs."""

    IDLE = 0
    F = 1  # the forward: sends the stage's output on, keeps its residuals
    B = 2  # the input gradient only (zero bubble's B): sends the gradient back
    W = 3  # the weight gradient only (zero bubble's W), then the update
    BW = 4  # the whole backward, fused: B and W of one micro-batch, then the update


BACKWARD = (Op.B, Op.BW)  # the ops that send a gradient to the previous stage
WEIGHTS = (Op.W, Op.BW)  # the ops that make a stage's weight gradient


class Task(NamedTuple):
    op: Op
    microbatch: int = NONE
    chunk: int = 0


def empty(ticks: int, stages: int, lanes: int) -> np.ndarray:
    """A table of idle tasks, `[ticks, stages, lanes, (op, micro-batch, chunk)]`."""
    table = np.zeros((ticks, stages, lanes, 3), np.int64)
    table[..., 1] = NONE
    return table


def put(table: np.ndarray, tick: int, stage: int, lane: int, task: Task) -> None:
    """Write `task` into a cell; a cell holds one task."""
    table[tick, stage, lane] = (int(task.op), task.microbatch, task.chunk)


def from_lanes(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """The table of two lanes: the forward lane's micro-batches `fwd[t, k]`
    as F tasks, then the backward lane's `bwd[t, k]` as fused BW tasks."""
    fwd, bwd = np.asarray(fwd, np.int64), np.asarray(bwd, np.int64)
    table = empty(*fwd.shape, 2)
    for lane, (op, mbs) in enumerate(((Op.F, fwd), (Op.BW, bwd))):
        busy = mbs != NONE
        table[..., lane, 0] = np.where(busy, int(op), int(Op.IDLE))
        table[..., lane, 1] = mbs
    return table
