"""What the conversion modules share: block names, hook names, the coordinators a model holds."""
from __future__ import annotations

from typing import (
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from torch import nn

from ..coordinator import FoldCoordinator
from ..layers import DirectWhitenWrapper, WhiteningLayer

#: Class names of the residual blocks whose convolutions are converted by default: ``BasicBlock`` and
#: ``Bottleneck`` (torchvision's, timm's and most CIFAR ResNets'), and Hugging Face transformers' ResNet blocks
#: ``ResNetBasicLayer`` and ``ResNetBottleNeckLayer``. A module is a block when its class or a base class has one
#: of these names.
DEFAULT_BLOCK_TYPES: Tuple[str, ...] = ("BasicBlock", "Bottleneck", "ResNetBasicLayer", "ResNetBottleNeckLayer")

Predicate = Callable[[str, nn.Module], bool]
BlockTypes = Union[str, type, Sequence[Union[str, type]]]

# Hook dictionaries of nn.Module that fire when the module is called.
_CALL_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
)
_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


def _is_whitening(m: nn.Module) -> bool:
    return isinstance(m, (WhiteningLayer, DirectWhitenWrapper))


def _share_hooks(src: nn.Module, dst: nn.Module, names: Iterable[str], move: bool = False) -> None:
    """Give ``dst`` the very hook dictionaries of ``src`` (existing handles keep working)."""
    for attr in names:
        d = getattr(src, attr)
        setattr(dst, attr, d)
        if move:
            setattr(src, attr, type(d)() if isinstance(d, dict) else None)


def _swap_in(model: nn.Module, new_for: Callable[[nn.Module], Optional[nn.Module]]) -> None:
    """Put ``new_for(module)`` (asked once per module; ``None``: keep the module) in the module's place in every
    parent that holds it (not inside a whitening layer)."""
    new_by_id: Dict[int, Optional[nn.Module]] = {}
    for parent in list(model.modules()):
        if _is_whitening(parent):
            continue
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in new_by_id:
                new_by_id[id(child)] = new_for(child)
            if new_by_id[id(child)] is not None:
                setattr(parent, child_name, new_by_id[id(child)])


def _coordinators(module: nn.Module) -> List[Tuple[int, FoldCoordinator]]:
    return [(k, h) for k, h in module._forward_hooks.items() if isinstance(h, FoldCoordinator)]


def _remove_coordinators(module: nn.Module) -> None:
    for key, coordinator in _coordinators(module):
        coordinator.layers = []  # (nothing kept alive by a coordinator that is gone)
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, attr, {}).pop(key, None)
    for key in [k for k, h in module._forward_pre_hooks.items() if isinstance(getattr(h, "__self__", None),
                                                                              FoldCoordinator)]:
        for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
            getattr(module, attr, {}).pop(key, None)
