"""whitenlayers: feature whitening for PyTorch, cheap enough to use.

Drop-in layers that whiten the inputs of convolutions, either directly
(:class:`DirectWhiten`) or, much cheaper, by transforming the weight gradients
(:class:`GradWhitenConv2d`, :class:`RecursiveWhitenConv2d`), after
Markovich-Golan, Battash and Bleiweiss, "Feature Whitening via Gradient
Transformation for Improved Convergence".
"""
from . import config, functional, models, testing
from .config import EVDConfig, RecursiveConfig
from .convert import (
    ConversionReport,
    DirectWhitened,
    conversion_report,
    convert_model,
    export_model,
    frozen,
    load_plain_state_dict,
    plain_state_dict,
    whitening_layers,
)
from .diagnostics import Diagnostics, collect_diagnostics, layer_diagnostics
from .layers import (
    DirectWhiten,
    GradWhitenConv1d,
    GradWhitenConv2d,
    GradWhitenConv3d,
    GradWhitenLinear,
    RecursiveWhitenConv1d,
    RecursiveWhitenConv2d,
    RecursiveWhitenConv3d,
    RecursiveWhitenLinear,
)
from .stats import WhiteningStatistics

__version__ = "0.1.0"

__all__ = [
    "DirectWhiten",
    "GradWhitenConv1d",
    "GradWhitenConv2d",
    "GradWhitenConv3d",
    "GradWhitenLinear",
    "RecursiveWhitenConv1d",
    "RecursiveWhitenConv2d",
    "RecursiveWhitenConv3d",
    "RecursiveWhitenLinear",
    "WhiteningStatistics",
    "EVDConfig",
    "RecursiveConfig",
    "config",
    "functional",
    "convert_model",
    "conversion_report",
    "ConversionReport",
    "export_model",
    "frozen",
    "whitening_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "DirectWhitened",
    "Diagnostics",
    "collect_diagnostics",
    "layer_diagnostics",
    "models",
    "testing",
]
