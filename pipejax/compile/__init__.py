"""The compiler: (plan, schedule, loss, optimizer) -> jitted `shard_map` programs.

This package is the front door: every module outside it imports what it
needs from `pipejax.compile`, never from a module of it (tests/test_structure.py).
Modules, in the order data flows through them:

- `programs`: the programs the facades (`Pipeline`, `Trainer`) need.
- `model`: the user's model as the compiler holds it; `ties`: tied weights across stages.
- `build`: the `Build`, placement, stage code, schedule, layout and mesh side by side.
- `stages`: stage k's code (forward, backward) as branch k of a switch; `sharing`:
  stages of one structure share a branch; `branches`: what one op of a branch runs.
- `residuals`: what a stage keeps from its forward to its backward.
- `split`, `cut`, `dot_order`, `split_ops`: zero bubble's B/W split of a backward, the
  minimum cut it files, its contractions' order, and B and W inside a tick.
- `last_stage`: when the last virtual stage's forward runs inside its backward.
- `precision`: float32 master weights, stages that compute in a lower dtype.
- `layout`: the packings and ring-buffer slots of a compiled pipeline, and their bytes;
  `rows`: one row of a ring buffer read and written.
- `shapes`: one pipeline at several micro-batch shapes.
- `microbatch`: a batch checked and split into micro-batches; `ids`: token ids checked.
- `spmd`: shard_map helpers, the stage axis.
- `lanes`, `messages`: a device's task read from the table; ring slots and the exchange.
- `table`, `table_state`, `op_loops`: the table interpreter, one scan over ticks with
  ppermute, what it carries, and an op's 0-or-1-trip loop; `metrics`: what a pass reports.
- `fsdp`, `tensor`: a stage sharded over the fsdp axis, parameters split over the tensor axis;
  `rendezvous`: no collective a device of a stage's group skips.
- `gradients`: what a backward does with its gradient (sum, or update in or after its loop).
- `versions`: PipeDream-2BW's two weight versions.
- `optimizer`: one optax transform per stage, its state packed; `pieces`: a sharded
  stage's optimizer state whole and back; `outer`: the update's parts around the chains.
- `synchronous`, `asynchronous`: the programs built on the interpreter.
- `memory`: the bytes a step needs per device, predicted before compiling.
- `state`: the typed state a trainer carries; `guard`: the CPU dispatch guard.
"""

from pipejax.compile.guard import guarded
from pipejax.compile.layout import Layout
from pipejax.compile.memory import MemoryEstimate, estimate
from pipejax.compile.messages import buffers, carried, collectives
from pipejax.compile.metrics import last_stage_cells
from pipejax.compile.model import Feed, Model
from pipejax.compile.pieces import into_pieces, state_parts
from pipejax.compile.precision import cast_floating, compute_weights
from pipejax.compile.programs import (Build, Flags, PipelinePrograms, Shapes, StageOptimizers,
                                      check_params, check_table, compile_build, crossing, id_ranges,
                                      key_or_default, opt_states, pipeline_programs, stage_rows,
                                      train_programs)
from pipejax.compile.split_ops import split_functions
from pipejax.compile.stages import StageCode
from pipejax.compile.state import InFlight, Rings, Staged, TrainState, host_array, unstage
from pipejax.compile.tensor import tensor_share

__all__ = ["Build", "Feed", "Flags", "InFlight", "Layout", "MemoryEstimate", "Model",
           "PipelinePrograms", "Rings", "Shapes", "StageCode", "StageOptimizers", "Staged",
           "TrainState", "buffers", "carried", "cast_floating", "check_params", "check_table",
           "collectives", "compile_build", "compute_weights", "crossing", "estimate", "guarded",
           "host_array", "id_ranges", "into_pieces", "key_or_default", "last_stage_cells",
           "opt_states", "pipeline_programs", "split_functions", "stage_rows", "state_parts",
           "tensor_share", "train_programs", "unstage"]
