"""whitenlayers: feature whitening for PyTorch, an exact, tested implementation of the paper's layers and conversion.

Drop-in layers that whiten the inputs of convolutions, either directly
(:class:`DirectWhiten`) or, much cheaper, by transforming the weight gradients
(:class:`GradWhitenConv2d`, :class:`RecursiveWhitenConv2d`), after
Markovich-Golan, Battash and Bleiweiss, "Feature Whitening via Gradient
Transformation for Improved Convergence".
"""
from . import config, functional, models, privacy
from .averaging import keep_counters
from .config import EVDConfig, RecursiveConfig
from .convert import (
    ConversionReport,
    DirectWhitenWrapper,
    conversion_report,
    convert_model,
    frozen,
    load_plain_state_dict,
    plain_state_dict,
    to_plain_model,
    whitening_layers,
)
from .coordinator import joinable
from .deferred import DeferredGradTransform, defer_grad_transform
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
    WhiteningLayer,
)
from .rules import Fold, RuleResult, TransformRule, register_rule

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
    "WhiteningLayer",
    "EVDConfig",
    "RecursiveConfig",
    "TransformRule",
    "Fold",
    "RuleResult",
    "register_rule",
    "config",
    "functional",
    "convert_model",
    "conversion_report",
    "ConversionReport",
    "to_plain_model",
    "frozen",
    "keep_counters",
    "whitening_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "DirectWhitenWrapper",
    "DeferredGradTransform",
    "defer_grad_transform",
    "joinable",
    "Diagnostics",
    "collect_diagnostics",
    "layer_diagnostics",
    "models",
]

privacy.register_if_loaded()  # Opacus' module validator refuses whitening layers (whitenlayers.privacy)

