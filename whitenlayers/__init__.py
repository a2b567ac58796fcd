"""whitenlayers: feature whitening for PyTorch, cheap enough to use.

Drop-in layers that whiten the inputs of convolutions, either directly
(:class:`DirectWhiten`) or, much cheaper, by transforming the weight gradients
(:class:`GradWhitenConv2d`, :class:`RecursiveWhitenConv2d`), after
Markovich-Golan, Battash and Bleiweiss, "Feature Whitening via Gradient
Transformation for Improved Convergence".
"""
from . import config, functional, models
from .config import EVDConfig, RecursiveConfig
from .layers import (
    DirectWhiten,
    GradWhitenConv2d,
    GradWhitenLinear,
    RecursiveWhitenConv2d,
    RecursiveWhitenLinear,
)
from .stats import WhiteningStatistics
from .convert import (
    DirectWhitened,
    convert_model,
    export_model,
    load_plain_state_dict,
    plain_state_dict,
    whitening_layers,
)
from .diagnostics import Diagnostics, collect_diagnostics, layer_diagnostics

__version__ = "0.1.0"

__all__ = [
    "DirectWhiten",
    "GradWhitenConv2d",
    "GradWhitenLinear",
    "RecursiveWhitenConv2d",
    "RecursiveWhitenLinear",
    "WhiteningStatistics",
    "EVDConfig",
    "RecursiveConfig",
    "config",
    "functional",
    "convert_model",
    "export_model",
    "whitening_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "DirectWhitened",
    "Diagnostics",
    "collect_diagnostics",
    "layer_diagnostics",
    "models",
]
