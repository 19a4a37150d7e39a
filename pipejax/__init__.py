"""pipejax: compile a list of Flax layers into one pipelined, jitted training step."""

from pipejax import data, errors, losses, models, partition, schedules
from pipejax.compile import InFlight, Layout, Staged, TrainState, unstage
from pipejax.mesh import simulate_devices
from pipejax.pipeline import Pipeline, pipeline
from pipejax.schedules import Schedule, StageInfo
from pipejax.trace import LayerSpec, apply_layers, trace
from pipejax.trainer import Trainer

__all__ = ["InFlight", "LayerSpec", "Layout", "Pipeline", "Schedule", "StageInfo", "Staged",
           "TrainState", "Trainer", "apply_layers", "data", "errors", "losses", "models",
           "partition", "pipeline", "schedules", "simulate_devices", "trace", "unstage"]
__version__ = "0.1.0"
