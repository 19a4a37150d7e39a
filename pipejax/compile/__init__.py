"""The compiler: (plan, schedule, loss, optimizer) -> one jitted shard_map step."""

from pipejax.compile.executor import Executor
from pipejax.compile.staged import StagedParams, TrainState, unstage

__all__ = ["Executor", "StagedParams", "TrainState", "unstage"]
