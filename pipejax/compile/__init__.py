"""The compiler: (plan, schedule, loss, optimizer) -> jitted `shard_map` programs.

`programs` is the front door: the facades (`Pipeline`, `Trainer`) import it
and nothing else of this package (docs/design.md). Modules, in the order
data flows through them:

- `programs`: the `Build` and the programs the facades need.
- `build`: the `Build`, placement, stage code, schedule, layout and mesh side by side.
- `stages`: stage k's code (forward, backward) as branch k of a switch.
- `residuals`: what a stage keeps from its forward to its backward.
- `layout`: the packings and ring-buffer slots of a compiled pipeline, and their bytes.
- `microbatch`: a batch checked and split into micro-batches.
- `spmd`: shard_map helpers, the stage axis, 0-or-1-trip loops.
- `lanes`, `messages`: a device's task read from the table; ring slots and the exchange.
- `table`: the table interpreter, one scan over ticks with ppermute; `metrics`: what a pass reports.
- `gradients`: what a backward does with its gradient (sum, or update in or after its loop).
- `optimizer`: one optax transform per stage, its state packed.
- `synchronous`, `asynchronous`: the programs built on the interpreter.
- `state`: the typed state a trainer carries; `guard`: the CPU dispatch guard.
"""

from pipejax.compile.guard import guarded
from pipejax.compile.layout import Layout
from pipejax.compile.stages import StageCode
from pipejax.compile.state import InFlight, Rings, Staged, TrainState, unstage

__all__ = ["InFlight", "Layout", "Rings", "StageCode", "Staged", "TrainState", "guarded", "unstage"]
