"""Staleness mitigations, hyper-parameter rules and data-parallel rules as
optax transformations.

Each works in any optax chain, inside or outside pipejax; the pipelined
executor runs a stage's forward on `forecast(...)` when that stage's chain
ends in `weight_forecast` (EQUATIONS.md, Kosson et al. 2020; SpecTrain), and
runs a `DataRule` (mean_gradients, gossip, elastic_average over named mesh
axes; H-ADPSGD, MXNET-MPI) around each stage's optimizer. The papers'
mitigations are ready recipes, one function each (`lwp_sc`, `spectrain`, ...,
`recipes.py`), and by name (`mitigation("lwp+sc", ...)`); the Adam-era ones
(`pipeoptim`, `nesterov`, SC on Adam's first moment) build on `AdamW`
(`adam.py`); `error_feedback` corrects a delayed update whatever the
optimizer, and `Muon` is a recipe's base where the recipe applies the
optimizer's own update (`muon.py`).
"""
from pipejax.transforms.data_parallel import (RULES, DataRule, ElasticState, GossipState, adpsgd,
                                              consensus_distance, elastic, elastic_average, gossip,
                                              hadpsgd, mean_gradients, ssgd)

from pipejax.transforms.adam import (AdamW, NAdamState, adam_spike_compensation,
                                     scale_by_nadam)
from pipejax.transforms.forecast import (DirectionState, WeightForecastState, forecast,
                                         forecast_horizon, forecasts_backward, has_forecast,
                                         update_direction, weight_forecast)
from pipejax.transforms.hyperparams import (LR_SCHEDULES, lr_schedule, pipemare_lr,
                                            scale_adam_hyperparams, scale_hyperparams)
from pipejax.transforms.adam_recipes import nesterov, pipeoptim
from pipejax.transforms.error_feedback import ErrorFeedbackState, ef, error_feedback
from pipejax.transforms.mitigations import MITIGATIONS, RECIPES, mitigation
from pipejax.transforms.muon import Muon
from pipejax.transforms.recipes import (Mitigation, lwp, lwp_sc, no_mitigation, pipemare, sc,
                                        spectrain, stash)
from pipejax.transforms.spike import SpikeCompensationState, coefficients, spike_compensation

__all__ = ["AdamW", "DirectionState", "NAdamState", "adam_spike_compensation", "nesterov",
           "pipeoptim", "scale_by_nadam", "scale_adam_hyperparams", "update_direction",
           "LR_SCHEDULES", "MITIGATIONS", "RECIPES", "RULES", "DataRule", "ElasticState",
           "GossipState", "Mitigation", "SpikeCompensationState", "WeightForecastState", "adpsgd",
           "coefficients", "consensus_distance", "ef", "elastic", "elastic_average",
           "error_feedback", "ErrorFeedbackState", "gossip", "hadpsgd", "mean_gradients", "ssgd",
           "forecast", "forecast_horizon", "forecasts_backward", "has_forecast", "lr_schedule",
           "lwp", "lwp_sc", "mitigation", "Muon", "no_mitigation", "pipemare", "pipemare_lr", "sc",
           "scale_hyperparams", "spectrain", "spike_compensation", "stash", "weight_forecast"]
