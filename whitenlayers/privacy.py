"""Differential privacy: Opacus' module validator refuses whitening layers, with the reason.

A whitening layer keeps exact statistics of its training batches (their mean, covariance and the transform made
of them) in its buffers and applies them to every later input, as a BatchNorm keeps its running statistics: state
computed from private samples that differential privacy's noise never touches. Opacus refuses BatchNorm for that
reason, through the registry of per-module checks that ``ModuleValidator.validate`` (and so
``PrivacyEngine.make_private``) runs; this module adds the whitening layers to that registry: every grad and
recursive layer, and, for ``method="direct"``, the conv or linear layer a :class:`DirectWhiten` sits in front of (a
``DirectWhiten`` has no parameters, and Opacus checks only modules that have some).

Opacus stays optional: nothing here imports it. The checks are registered where Opacus' validators are loaded
already when whitenlayers is imported, and when :func:`~whitenlayers.convert_model` converts a model; after a later
first import of Opacus, call :func:`register_opacus_validators` (or convert after importing Opacus).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Iterator, List, Optional

from torch import nn

__all__ = ["register_opacus_validators"]

#: What a whitening layer keeps of the batches, and what to do instead (every error's reason).
WHY = ("it keeps exact, un-noised statistics of the training batches (their mean, covariance and the whitening "
       "transform made of them) in its buffers and applies them to every later input, as BatchNorm does, which "
       "Opacus refuses for the same reason: differential privacy would not cover them. Train a model without "
       "whitening under Opacus (the plain model, wl.to_plain_model(copy.deepcopy(model)), or one never converted)")

#: The plain layers a ``direct`` wrapper holds, each to a weak reference to its wrapper (``note_direct``).
_DIRECT: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
#: The layer types whose validators are ours (also for plain conv / linear layers: chained to any earlier one).
_PLAIN_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_VALIDATORS_MODULE = "opacus.validators"


def note_direct(wrapper: Any) -> None:
    """Remember that ``wrapper.layer`` is whitened by ``wrapper`` (a ``DirectWhitenWrapper``, when it is built or
    unpickled): Opacus checks the plain layer, which has the parameters."""
    _DIRECT[wrapper.layer] = weakref.ref(wrapper)


def _unsupported(message: str) -> List[Exception]:
    from opacus.validators.errors import UnsupportedModuleError

    return [UnsupportedModuleError(message)]


def _validate_whitening_layer(module: Any, **kwargs: Any) -> List[Exception]:
    return _unsupported(f"{module._describe()} cannot be trained with differential privacy: {WHY}")


def _validate_plain(previous: Optional[Callable[..., List[Exception]]]) -> Callable[..., List[Exception]]:
    def validate(module: nn.Module, **kwargs: Any) -> List[Exception]:
        ref = _DIRECT.get(module)
        wrapper = ref() if ref is not None else None
        errors: List[Exception] = []
        if wrapper is not None and wrapper.layer is module:
            errors += _unsupported(
                f"{wrapper.whiten._describe()} whitens the input of this {type(module).__name__} "
                f"(method='direct') and cannot be trained with differential privacy: {WHY}")
        if previous is not None:
            errors += previous(module, **kwargs)
        return errors

    validate._whitenlayers = True  # type: ignore[attr-defined]
    return validate


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def register_opacus_validators() -> None:
    """Add the whitening layers to Opacus' ``ModuleValidator`` registry (idempotent). Called for you where Opacus'
    validators are loaded, when whitenlayers is imported and by :func:`~whitenlayers.convert_model`; call it after a
    later first import of Opacus, or after defining a subclass of a whitening layer, whose exact type Opacus looks
    up."""
    from opacus.validators.module_validator import ModuleValidator

    from .layers.base import WhiteningLayer

    registry = ModuleValidator.VALIDATORS
    for cls in _subclasses(WhiteningLayer):
        registry[cls] = _validate_whitening_layer
    for cls in _PLAIN_TYPES:
        previous = registry.get(cls)
        if not getattr(previous, "_whitenlayers", False):
            registry[cls] = _validate_plain(previous)


def register_if_loaded() -> None:
    """:func:`register_opacus_validators` where Opacus' validators are loaded (at import and conversion)."""
    if _VALIDATORS_MODULE in sys.modules:
        register_opacus_validators()
