"""Staleness mitigations and hyper-parameter rules as optax transformations.

Each works in any optax chain, inside or outside pipejax; the pipelined
executor runs a stage's forward on `forecast(...)` when that stage's chain
ends in `weight_forecast` (EQUATIONS.md, Kosson et al. 2020; SpecTrain).
"""

from pipejax.transforms.forecast import (WeightForecastState, forecast, forecast_horizon,
                                         has_forecast, weight_forecast)
from pipejax.transforms.hyperparams import pipemare_lr, scale_hyperparams
from pipejax.transforms.mitigations import MITIGATIONS, Mitigation, mitigation
from pipejax.transforms.spike import SpikeCompensationState, coefficients, spike_compensation

__all__ = ["MITIGATIONS", "Mitigation", "SpikeCompensationState", "WeightForecastState",
           "coefficients", "forecast", "forecast_horizon", "has_forecast", "mitigation",
           "pipemare_lr", "scale_hyperparams", "spike_compensation", "weight_forecast"]
