"""What the conversion modules share: block names, layer classes by method, hook names, the direct wrapper."""
from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Sequence,
    Tuple,
    Union,
    cast,
)

import torch
from torch import Tensor, nn

from .._deprecated import module_getattr
from ..autograd import shared_weight_product_apply
from ..coordinator import FoldCoordinator, ForwardBegins
from ..fold import _autocast_enabled, _no_autocast
from ..functional import transform_weight_grad
from ..layers import (
    DirectWhiten,
)
from ..layers._base import (
    _bias_of,
    _check_input,
    _check_not_tracing_function,
    _distributed,
    plannable_forward,
    share_weight_transforms,
)
from ..privacy import note_direct
from ..stats import WhiteningLayer
from ..stats.step import _saved_tensor_hooks

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
        whiten.__dict__["_wrapper"] = self  # where plan_forward finds the layer it whitens for (not pickled)
        note_direct(self)  # Opacus' validator checks the wrapped layer (whitenlayers.privacy)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        note_direct(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The whitening layer's check of a checkpoint of another method: a grad / recursive layer's keys sit here,
        # at the wrapper's place, which the DirectWhiten's own load (given only its keys) does not see.
        self.whiten._check_checkpoint_method(state_dict, prefix + "whiten.", error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def forward(self, x: Tensor) -> Tensor:
        """``layer(whiten(x))``, computed as ``layer(x - mu)`` with the weight ``W T`` where that is the same.

        A plain conv or linear layer (``nn.Conv1d/2d/3d``, ``nn.Linear``) after a dense ``T`` (``groups=1``), with
        no hooks on either module, takes its weight times ``T`` on the input-feature axis instead of the whitened
        input: ``conv(pad(T (x - mu)), W) = conv(pad(x - mu), W T)`` (every padding mode pads each position's
        features as a whole, which ``T`` does not mix), and the gradients of ``W`` and ``x`` are those of the
        whitened form (``dW = dW' T^T``, ``dx = T^T conv^T(dz, W)``), up to rounding. One subtraction on the input
        and one small product on the weight replace two 1x1 products over the activations (forward and
        backward). Otherwise (hooks, a grouped ``T``, another layer type) the two modules are called in turn.

        Args:
            x: the wrapped layer's input (features on dim 1 for a conv, on the last dim for an ``nn.Linear``).
        """
        whiten = self.whiten
        plan = whiten.__dict__.pop("_planned", None)
        if (plan is not None and plan[0] is self and x.dim() == plan[1].dim() and whiten.training
                and torch.is_grad_enabled() and _saved_tensor_hooks() is None):
            # (under activation checkpointing the full path: a recomputed forward saves what its original saved)
            return self._planned_forward(x, plan)
        whiten.__dict__["_wrapper"] = self  # (again after a copy or a pickle, which leave it out)
        if self._fusable():
            return self._fused_forward(x)
        if isinstance(self.layer, nn.Linear) and x.dim() != 2:
            # A linear layer acts on the last dim: whiten the (N, C) rows of x (statistics over all leading dims).
            return self.layer(self.whiten(x.reshape(-1, x.shape[-1])).reshape(x.shape))
        return self.layer(self.whiten(x))

    def _fusable(self) -> bool:
        whiten, layer = self.whiten, self.layer
        if type(layer) not in _FUSED_LAYERS or whiten.groups != 1:
            return False
        for module in (whiten, layer):
            if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                    or module._backward_pre_hooks):
                return False
        return not _global_module_hooks()

    def _fused_forward(self, x: Tensor) -> Tensor:
        """``layer(x - mu)`` with the weight ``W T`` (:meth:`forward`)."""
        whiten, layer = self.whiten, cast(Any, self.layer)
        linear = type(layer) is nn.Linear
        training, state = whiten._begin(x.reshape(-1, x.shape[-1]) if linear and x.dim() != 2 else x)
        t, mean = state["whitening_matrix"], state["running_mean"]
        if torch.is_grad_enabled() and x.requires_grad:  # as the DirectWhiten's own forward (its Function)
            _check_not_tracing_function(whiten, "the whitening's backward")
        w = layer.weight
        if _autocast_enabled(w.device.type):  # W T in the weight's dtype (autocast would multiply in bf16 / fp16)
            with _no_autocast(w.device):
                wt = transform_weight_grad(w, t)
        else:
            wt = transform_weight_grad(w, t)
        shift = whiten._shift_for(mean, x, linear)
        if linear:
            out = nn.functional.linear(x - shift, wt, layer.bias)
        else:
            out = layer._conv_forward(x - shift, wt, layer.bias)
        if training:
            whiten._end_batch()
        return out

    def _planned_forward(self, x: Tensor, plan: tuple) -> Tensor:
        """:meth:`_fused_forward` as planned by the model's fold coordinator (:func:`plan_forward`): ``W T`` made by
        the model's shared product node, the checks that hold for the whole forward made there."""
        _, wt, state, gather, end, sink = plan
        whiten, layer = self.whiten, cast(Any, self.layer)
        _check_input(whiten, x, dim=1, ndims=_INPUT_DIMS, what=_INPUT_WHAT)
        whiten.__dict__["_in_force"] = state
        if gather:  # (handed over as DirectWhiten's own forward does: while the input is in the recorded graph)
            whiten._planned_stats(x, gather, sink if x.requires_grad else None)
        linear = type(layer) is nn.Linear
        shift = whiten._shift_for(state["running_mean"], x, linear)
        bias = _bias_of(layer)
        if linear:
            out = nn.functional.linear(x - shift, wt, bias)
        else:
            out = layer._conv_forward(x - shift, wt, bias)
        whiten._planned_end(end)
        return out


#: DirectWhiten's input check (``_check_input``'s ranks and wording), for the planned forward.
_INPUT_DIMS = tuple(range(2, 9))
_INPUT_WHAT = "an input of shape (B, C) or (B, C, *spatial)"


def plan_forward(layers: Sequence[Any], module: nn.Module) -> bool:
    """A converted model's :attr:`FoldCoordinator.on_forward` (set by ``convert_model``): before each forward,
    in a :func:`~whitenlayers.layers._base.plannable_forward`, the grad / recursive layers' steps planned and, in
    one process, their weights through one shared gradient-transform node
    (:func:`~whitenlayers.layers._base.share_weight_transforms`); in one process, the fused ``direct`` wrappers'
    ``W T`` made by one :class:`~whitenlayers.autograd.SharedWeightProduct` with their steps planned
    (:meth:`DirectWhitenWrapper._planned_forward`). Returns whether it left anything on the layers (dropped at the
    forward's end if unused)."""
    if not plannable_forward(module):
        return False
    planned = share_weight_transforms(layers, module, checked=True)
    if _distributed():  # (DDP all-reduces a weight's gradient while the backward runs: no shared product node)
        return planned
    return _plan_direct(layers) or planned


def _plan_direct(layers: Sequence[Any]) -> bool:
    """:func:`plan_forward`'s part for the fused ``direct`` wrappers: their training forwards in this model's forward,
    with a weight Parameter that needs a gradient, on the device of the first."""
    chosen: List[Tuple[Any, DirectWhiten, Any]] = []
    weights: List[Tensor] = []
    device = None
    for layer in layers:
        wrapper = layer.__dict__.get("_wrapper")
        if wrapper is None or wrapper.whiten is not layer or not layer.training or not wrapper._fusable():
            continue
        w = wrapper.layer._parameters.get("weight")
        if type(w) is not nn.Parameter or not w.requires_grad or (device is not None and w.device != device):
            continue
        device = w.device
        state = layer._forward_snapshot()
        chosen.append((wrapper, layer, state))
        weights.append(w)
    if not chosen:
        return False
    coordinator = chosen[0][1]._fold_coordinator
    sink = None if coordinator is None else coordinator.stats_sink()
    ts, ts_transposed = [], []
    for _, layer, state in chosen:
        t = state["whitening_matrix"]  # T^T as a view made once per snapshot (a view op is a dispatch)
        kept = layer.__dict__.get("_t_transposed")
        if kept is None or kept[0] is not t:
            kept = layer.__dict__["_t_transposed"] = (t, t.mT)
        ts.append(t)
        ts_transposed.append(kept[1])
    products = shared_weight_product_apply(tuple(ts), tuple(ts_transposed), *weights)
    for (wrapper, layer, state), wt in zip(chosen, products):
        counts = layer._step_counts(wt.dim(), wt.device) if layer._fold_coordinator is coordinator else None
        if counts is not None and "_is_replica" not in layer.__dict__:
            layer.__dict__["_planned"] = (wrapper, wt, state, counts[0], counts[1], sink)
    return True


#: The layers whose weight DirectWhitenWrapper multiplies by T instead of whitening their input.
_FUSED_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def _global_module_hooks() -> bool:
    """Whether any global module hook (``nn.modules.module.register_module_forward_hook`` and kin) is registered:
    it would see the two modules' calls."""
    mod = nn.modules.module
    return any(getattr(mod, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                     "_global_backward_hooks", "_global_backward_pre_hooks"))


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
