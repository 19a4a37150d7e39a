"""pipejax: compile a list of Flax layers into one pipelined, jitted training step."""

from pipejax import data, errors, losses, models, partition, schedules
from pipejax.compile import StagedParams, TrainState, unstage
from pipejax.mesh import simulate_devices
from pipejax.pipeline import Pipeline
from pipejax.schedules import Schedule, StageInfo
from pipejax.trace import LayerSpec, apply_layers, trace


def pipeline(layers, **kwargs) -> Pipeline:
    """Trace, partition, schedule and compile `layers`; see `Pipeline` for the options."""
    return Pipeline(layers, **kwargs)


__all__ = ["LayerSpec", "Pipeline", "Schedule", "StageInfo", "StagedParams", "TrainState",
           "apply_layers", "data", "errors", "losses", "models", "partition", "pipeline", "schedules",
           "simulate_devices", "trace", "unstage"]
__version__ = "0.1.0"
