"""The whitening methods by name: one registry of name -> config class -> layer classes.

:func:`~whitenlayers.convert_model`, :func:`~whitenlayers.conversion_report`, the diagnostics and the
experiment runner all read it, so a method's name, its hyper-parameters and the layers that implement it are
written once.

Example:
    >>> from whitenlayers.methods import METHODS, get_method
    >>> tuple(METHODS)
    ('grad', 'recursive', 'direct')
    >>> get_method("recursive").config.__name__, get_method("direct").exclude
    ('RecursiveConfig', ('beta',))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type

from torch import nn

from .config import EVDConfig, RecursiveConfig, WhiteningConfig
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
from .layers.base import split_options
from .rules import TransformRule, rule_and_config

__all__ = ["WhiteningMethod", "METHODS", "get_method"]


@dataclass(frozen=True)
class WhiteningMethod:
    """One method: its name, its config class, and the whitening layer class for each plain module type.

    ``layers`` maps ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` / ``nn.Linear`` to the class that replaces it;
    a method that wraps its target instead (``direct``: :class:`~whitenlayers.DirectWhiten` in front of the
    unchanged layer) has ``wrapper`` set and no ``layers``. ``exclude`` lists the config fields its layers do not
    take; ``rule`` is the name of its transform rule (``layer.rule_name``: ``"evd"`` or ``"recursive"``).

    Args:
        name: the method's name, as ``convert_model(method=...)`` and the runner take it.
        config: its config class (:class:`~whitenlayers.EVDConfig` or :class:`~whitenlayers.RecursiveConfig`).
        rule: the name of its transform rule, ``"evd"`` or ``"recursive"``.
        layers: plain module type -> whitening class replacing it (default: empty, for a wrapping method).
        wrapper: the whitening class put in front of the target instead (default ``None``).
        exclude: config fields its layers do not take (default none).
    """

    name: str
    config: Type[WhiteningConfig]
    rule: str
    layers: Mapping[type, type] = field(default_factory=dict)
    wrapper: Optional[type] = None
    exclude: Tuple[str, ...] = ()

    def layer_class(self, module: nn.Module) -> type:
        """The whitening class that replaces ``module`` (the first plain type it is an instance of).

        Args:
            module: a plain ``nn.Conv1d/2d/3d`` or ``nn.Linear``; another type is a ``TypeError``.
        """
        for plain, cls in self.layers.items():
            if isinstance(module, plain):
                return cls
        raise TypeError(f"method {self.name!r} has no whitening layer for {type(module).__name__}")

    def rule_and_config(self, owner: str, kwargs: Mapping[str, Any]) -> Tuple[Type[TransformRule], WhiteningConfig]:
        """The rule class and the config that layers built with ``kwargs`` get, as the layers make them
        (:func:`~whitenlayers.rules.rule_and_config`): ``TypeError`` for a keyword this method's layers do not
        take, a ``config`` of another class or a rule that does not take this method's config; ``ValueError``
        naming a value out of its range.

        Args:
            owner: the name the messages give (``"convert_model"``).
            kwargs: the layer keyword arguments (``config=``, ``rule=`` and whitening hyper-parameters; others
                ignored).
        """
        options, whitening = split_options(dict(kwargs))
        return rule_and_config(self.config, owner, options["config"], {**whitening, "rule": options["rule"]},
                               exclude=self.exclude)


_LINEAR_AND_CONVS = (nn.Linear, nn.Conv2d, nn.Conv1d, nn.Conv3d)

METHODS: Dict[str, WhiteningMethod] = {
    "grad": WhiteningMethod("grad", EVDConfig, "evd", dict(zip(_LINEAR_AND_CONVS, (
        GradWhitenLinear, GradWhitenConv2d, GradWhitenConv1d, GradWhitenConv3d)))),
    "recursive": WhiteningMethod("recursive", RecursiveConfig, "recursive", dict(zip(_LINEAR_AND_CONVS, (
        RecursiveWhitenLinear, RecursiveWhitenConv2d, RecursiveWhitenConv1d, RecursiveWhitenConv3d)))),
    "direct": WhiteningMethod("direct", EVDConfig, "evd", wrapper=DirectWhiten,
                              exclude=DirectWhiten._unused_fields),
}


def get_method(name: str) -> WhiteningMethod:
    """The method called ``name``; ``ValueError`` naming the choices otherwise.

    Args:
        name: ``"grad"``, ``"recursive"`` or ``"direct"`` (the keys of ``METHODS``).
    """
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"method must be one of {tuple(METHODS)}, but got method={name!r}") from None
