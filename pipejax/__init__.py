"""pipejax: compile a list of Flax layers into one pipelined, jitted training step."""

from pipejax import (checkpoint, data, distributed, errors, layers, losses, models, partition,
                     schedules, transforms)
from pipejax.checkpoint import restore, save
from pipejax.compile import InFlight, Layout, Staged, TrainState, unstage
from pipejax.caches import cache_sizes, clear_caches
from pipejax.mesh import make_mesh, simulate_devices
from pipejax.placed import Placed, parameters
from pipejax.pipeline import Pipeline, pipeline
from pipejax.placement import Placement
from pipejax.planner import Candidate, search
from pipejax.schedules import Schedule, StageInfo
from pipejax.stage_layout import Gather, StageLayout
from pipejax.delayed import Simulation, simulate
from pipejax.evaluation import evaluator, loss_evaluator
from pipejax.generation import generate
from pipejax.layers import apply_layers
from pipejax.trace import LayerSpec, trace
from pipejax.trainer import Trainer

__all__ = ["Candidate", "Gather", "InFlight", "LayerSpec", "Layout", "Pipeline", "Placed", "Placement",
           "Schedule", "StageInfo", "StageLayout", "Staged", "Simulation", "TrainState", "Trainer",
           "apply_layers", "cache_sizes", "checkpoint", "clear_caches", "data", "distributed",
           "errors", "evaluator",
           "generate", "layers", "loss_evaluator", "losses", "make_mesh", "models",
           "parameters", "partition", "pipeline", "restore", "save", "schedules", "search",
           "simulate", "simulate_devices", "trace", "transforms", "unstage"]
__version__ = "0.1.0"
