"""whitenlayers: feature whitening for PyTorch, cheap enough to use.

Drop-in layers that whiten the inputs of convolutions, either directly
(:class:`DirectWhiten`) or, much cheaper, by transforming the weight gradients
(:class:`GradWhitenConv2d`, :class:`RecursiveWhitenConv2d`), after
Markovich-Golan, Battash and Bleiweiss, "Feature Whitening via Gradient
Transformation for Improved Convergence".
"""
from . import functional
from .layers import (
    DirectWhiten,
    GradWhitenConv2d,
    GradWhitenLinear,
    RecursiveWhitenConv2d,
    RecursiveWhitenLinear,
)
from .stats import FoldCoordinator, WhiteningStatistics, fold_layers

__version__ = "0.1.0"

__all__ = [
    "DirectWhiten",
    "GradWhitenConv2d",
    "GradWhitenLinear",
    "RecursiveWhitenConv2d",
    "RecursiveWhitenLinear",
    "WhiteningStatistics",
    "FoldCoordinator",
    "fold_layers",
    "functional",
]
