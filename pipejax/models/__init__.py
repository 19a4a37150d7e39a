"""Models as Flax layer lists, so that a pipeline can split them."""

from pipejax.models.mlp import mlp

__all__ = ["mlp"]
