"""What the conversion modules share: block names, layer classes by method, hook names, the direct wrapper."""
from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Callable,
    Iterable,
    List,
    Sequence,
    Tuple,
    Union,
)

from torch import Tensor, nn

from .._deprecated import module_getattr
from ..coordinator import FoldCoordinator, ForwardBegins
from ..layers import (
    DirectWhiten,
)
from ..stats import WhiteningLayer

if TYPE_CHECKING:  # pragma: no cover
    pass

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


class DirectWhitenWrapper(nn.Module):
    """``layer(whiten(x))``: a :class:`~whitenlayers.DirectWhiten` in front of a conv or linear layer.

    What ``convert_model(..., method="direct")`` puts in place of a target.
    ``layer`` is the original module object (same Parameters, same
    state-dict hooks); the forward/backward hooks that were registered on it
    are moved to this wrapper, so they see the same input and output as
    before the conversion.

    Args:
        whiten: the :class:`~whitenlayers.DirectWhiten` applied first; its ``num_features`` (and
            ``groups``) must match ``layer``'s input (``in_channels`` / ``in_features``).
        layer: the conv or linear layer applied to the whitened input, unchanged.
    """

    def __init__(self, whiten: DirectWhiten, layer: nn.Module) -> None:
        super().__init__()
        self.whiten = whiten
        self.layer = layer

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The whitening layer's check of a checkpoint of another method: a grad / recursive layer's keys sit here,
        # at the wrapper's place, which the DirectWhiten's own load (given only its keys) does not see.
        self.whiten._check_checkpoint_method(state_dict, prefix + "whiten.", error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: Tensor) -> Tensor:
        """``layer(whiten(x))``.

        Args:
            x: the wrapped layer's input (features on dim 1 for a conv, on the last dim for an ``nn.Linear``).
        """
        if isinstance(self.layer, nn.Linear) and x.dim() != 2:
            # A linear layer acts on the last dim: whiten the (N, C) rows of x (statistics over all leading dims).
            return self.layer(self.whiten(x.reshape(-1, x.shape[-1])).reshape(x.shape))
        return self.layer(self.whiten(x))


def _is_whitening(m: nn.Module) -> bool:
    return isinstance(m, (WhiteningLayer, DirectWhitenWrapper))


def _share_hooks(src: nn.Module, dst: nn.Module, names: Iterable[str], move: bool = False) -> None:
    """Give ``dst`` the very hook dictionaries of ``src`` (existing handles keep working)."""
    for attr in names:
        if hasattr(src, attr):
            d = getattr(src, attr)
            setattr(dst, attr, d)
            if move:
                setattr(src, attr, type(d)() if isinstance(d, dict) else None)


def _coordinators(module: nn.Module) -> List[Tuple[int, FoldCoordinator]]:
    return [(k, h) for k, h in module._forward_hooks.items() if isinstance(h, FoldCoordinator)]


def _remove_coordinators(module: nn.Module) -> None:
    for key, _ in _coordinators(module):
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, attr, {}).pop(key, None)
    for key in [k for k, h in module._forward_pre_hooks.items() if isinstance(h, ForwardBegins)]:
        for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
            getattr(module, attr, {}).pop(key, None)

__getattr__ = module_getattr("whitenlayers.convert._common", "DirectWhitened")  # pickles of old direct models
