"""Cost-based partitioning of a layer list into contiguous stages."""

from pipejax.partition.balance import balance, check_split, objective_value, stage_costs
from pipejax.partition.fold import balance_folded
from pipejax.partition.plan import Plan, make_plan

__all__ = ["Plan", "balance", "balance_folded", "check_split", "make_plan", "objective_value",
           "stage_costs"]
