"""Models as Flax layer lists, so that a pipeline can split them; one residual
block is one layer. Small, configurable defaults that train in minutes."""

from pipejax.models.gpt import gpt
from pipejax.models.mlp import mlp
from pipejax.models.residual_lstm import residual_lstm
from pipejax.models.resnet import resnet
from pipejax.models.snn import snn
from pipejax.models.transformer import transformer
from pipejax.models.vgg import vgg

MODELS = {"mlp": mlp, "snn": snn, "resnet": resnet, "vgg": vgg, "transformer": transformer,
          "residual_lstm": residual_lstm, "gpt": gpt}

__all__ = ["MODELS", "gpt", "mlp", "residual_lstm", "resnet", "snn", "transformer", "vgg"]
