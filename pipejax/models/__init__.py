"""Models as Flax layer lists, so that a pipeline can split them; one residual
block is one layer. Small, configurable defaults that train in minutes;
`MODELS` is the zoo by name (zoo.py)."""

from pipejax.models.gpt import gpt, gpt_muon_dimensions
from pipejax.models.mlp import mlp
from pipejax.models.residual_lstm import residual_lstm
from pipejax.models.resnet import resnet
from pipejax.models.snn import snn
from pipejax.models.transformer import transformer
from pipejax.models.vgg import vgg
from pipejax.models.zoo import MODELS, ZooModel

__all__ = ["MODELS", "ZooModel", "gpt", "gpt_muon_dimensions", "mlp", "residual_lstm", "resnet",
           "snn", "transformer", "vgg"]
