"""The weight-gradient transform at the optimizer's step instead of in the backward (opt-in).

By default a grad / recursive layer multiplies its weight gradient by ``Q_s`` in the backward, through a custom
autograd Function: a Python node in every layer's backward on every step. On a GPU, where a converted model's step
is bound by the host's time, that node is one of the largest costs a layer adds. :func:`defer_grad_transform`
takes it out of the backward: the backward leaves the weight gradients as the plain model's, and one pre-hook of
the optimizer's ``step`` multiplies each of them by its ``Q_s`` in place.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, cast

import torch
from torch import Tensor, nn

from .functional import transform_weight_grad
from .stats import WhiteningLayer

__all__ = ["DeferredGradTransform", "defer_grad_transform"]


class DeferredGradTransform:
    """What :func:`defer_grad_transform` returns: the deferral in force. :meth:`remove` ends it."""

    def __init__(self, layers: Sequence[WhiteningLayer], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.layers: List[WhiteningLayer] = list(layers)
        self.optimizers: List[torch.optim.Optimizer] = list(optimizers)
        self._handles: List[Any] = []
        #: per optimizer: the deferred layers whose weight it steps
        self._stepped: Dict[int, List[WhiteningLayer]] = {}

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        # args: the optimizer itself, then step's own (a closure)
        layers = self._stepped.get(id(optimizer), [])
        closure = kwargs.get("closure")
        positional = closure is None and len(args) > 1 and args[1] is not None
        if positional:
            closure = args[1]
        if closure is None:
            transform_gradients(layers)
            return None

        # A step with a closure (LBFGS; Lightning's automatic optimization passes one to every optimizer) computes
        # the gradients inside the step, after this hook: each call of the closure transforms what its backward
        # left, before the optimizer reads it.
        def closure_then_transform() -> Any:
            loss = closure()
            transform_gradients(layers)
            return loss

        if positional:
            return (args[0], closure_then_transform) + tuple(args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_transform}

    def remove(self) -> None:
        """End the deferral: the layers transform their gradients in the backward again. Gradients still waiting
        for their transform (a backward since the last step) are transformed now."""
        transform_gradients(self.layers)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for layer in self.layers:
            layer.__dict__.pop("_deferred_grad", None)
            layer.__dict__.pop("_deferred_q", None)

    def __enter__(self) -> "DeferredGradTransform":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


@torch.no_grad()
def transform_gradients(layers: Sequence[WhiteningLayer]) -> None:
    """Multiply each deferred layer's weight gradient, in place, by the ``Q_s`` it waits for (the one in force at
    its forward), and clear the wait. A layer with nothing waiting, or no gradient, is left alone."""
    for layer in layers:
        q: Optional[Tensor] = layer.__dict__.get("_deferred_q")
        if q is None:
            continue
        layer.__dict__["_deferred_q"] = None
        weight: Tensor = cast(Any, layer).weight
        grad = weight.grad
        if grad is None:
            continue
        if hasattr(grad, "to_local") or tuple(grad.shape) != _weight_shape(layer):
            raise RuntimeError(
                f"{layer._describe()}: defer_grad_transform needs the full weight gradient at the optimizer's step, "
                f"but got a gradient of shape {tuple(grad.shape)} ({type(grad).__name__}) for a weight of shape "
                f"{_weight_shape(layer)} (a sharded wrapper such as FSDP): use the default transform in the backward")
        if getattr(layer, "features", "channels") == "patches":  # Q acts on the flattened C k^2 axis
            new = transform_weight_grad(grad.flatten(1), q).view_as(grad)
        else:
            new = transform_weight_grad(grad, q)
        grad.copy_(new)  # in place: a DDP bucket view, or any wrapper's, stays linked


def _sharding(model: nn.Module, layers: Sequence[Any]) -> Optional[str]:
    """What shards the layers' weights, if anything does: an FSDP1 wrapper in the model, or DTensor weights (FSDP2's
    ``fully_shard``, tensor parallelism)."""
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            return "FullyShardedDataParallel"
    for layer in layers:
        if hasattr(layer.weight, "to_local"):
            return f"the weight of {layer._describe()} is a {type(layer.weight).__name__}, as fully_shard makes it"
    return None


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer whose ``step`` runs the hooks: a wrapper's own (Hugging Face Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) passes the step on to the optimizer it wraps, and
    never initialised ``Optimizer``'s hooks."""
    inner = optimizer
    for _ in range(8):  # wrappers of wrappers, not a cycle
        wrapped = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if not isinstance(wrapped, torch.optim.Optimizer) or wrapped is inner:
            break
        inner = wrapped
    if not isinstance(inner, torch.optim.Optimizer) or not hasattr(inner, "_optimizer_step_pre_hooks"):
        raise TypeError(
            f"defer_grad_transform: expected torch.optim.Optimizer instances (or a wrapper holding one as "
            f"`.optimizer`), but got {type(optimizer).__name__}, whose step runs no optimizer step hooks")
    return inner


def _weight_shape(layer: Any) -> Tuple[int, ...]:
    """The shape of the layer's whole weight (a sharded wrapper may hold a flat piece of it instead)."""
    if hasattr(layer, "kernel_size"):
        return (layer.out_channels, layer.in_channels // layer.groups) + tuple(layer.kernel_size)
    return (layer.out_features, layer.in_features)


def defer_grad_transform(model: nn.Module, *optimizers: torch.optim.Optimizer) -> DeferredGradTransform:
    """Transform the weight gradients of ``model``'s grad / recursive layers at the optimizer's step, not in the
    backward.

    Each layer's backward then computes its weight gradient as the plain layer does (no Python autograd node), and
    a pre-hook of ``step`` on each of ``optimizers`` multiplies the gradient by ``Q_s`` on the input-feature axis,
    in place, before the update: the same update as the default, with less host time per layer and step (on the
    ResNet-50 layout of ``benchmarks/host_overhead.py`` on a CPU, ~190 -> ~125 us per layer). ``DirectWhiten``
    layers are not concerned (they have no gradient transform).

    What changes for the training loop:

    * between ``backward()`` and ``step()`` the weight gradients are the untransformed ones: gradient clipping,
      logging or anything else there sees those;
    * the ``Q_s`` is the one in force at the layer's last forward (with gradients enabled) before the step, for
      the whole gradient the step applies. That is the default's ``Q_s`` unless a fold falls between the forwards
      of one optimizer step: set the layers' ``accumulation_steps`` to the number of backward passes per step
      (then blocks end on step boundaries). A step that ``GradScaler`` skips changes nothing here, however the
      gradients are cleared;
    * a step with a closure (LBFGS, Lightning's automatic optimization) transforms the gradients after each call
      of the closure, inside the step: anything the closure does after its ``backward()`` (Lightning clips the
      gradients there) sees the untransformed ones;
    * a sharded model (FSDP1's wrapper, FSDP2's ``fully_shard``) is refused here, and a gradient whose shape is
      not the weight's at the step; under DDP the reduced gradient is transformed (the same on every rank);
    * a layer running inside a ``torch.compile``'d graph keeps the default transform in its backward.

    Args:
        model: a model converted by :func:`~whitenlayers.convert_model`, or any module holding grad / recursive
            whitening layers.
        *optimizers: the optimizers that step those layers' weights, together every one of them. A wrapper
            (Hugging Face Accelerate's ``AcceleratedOptimizer``, which the ``Trainer`` uses; Lightning's
            ``LightningOptimizer``) stands for the optimizer it wraps.

    Returns:
        A :class:`DeferredGradTransform`; its ``remove()`` (or leaving it as a context manager) goes back to the
        transform in the backward.

    Example:
        >>> import torch, whitenlayers as wl
        >>> model = torch.nn.Sequential(wl.GradWhitenLinear(4, 3))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> deferral = wl.defer_grad_transform(model, opt)
        >>> model(torch.randn(8, 4)).square().sum().backward()
        >>> opt.step()
        >>> deferral.remove()
    """
    if not optimizers:
        raise ValueError("defer_grad_transform needs the optimizers that step the model's weights, but got none")
    layers: List[Any] = [m for m in model.modules() if isinstance(m, WhiteningLayer) and "grad_transform" in m._buffers]
    if not layers:
        raise ValueError(f"defer_grad_transform: {type(model).__name__} has no grad or recursive whitening layer")
    sharding = _sharding(model, layers)
    if sharding is not None:
        raise ValueError(
            f"defer_grad_transform: {type(model).__name__} is sharded ({sharding}): at the optimizer's step each rank "
            f"holds only a shard of each weight gradient; use the default transform in the backward, which "
            f"transforms each gradient before it is sharded")
    optimizers = tuple(_innermost(opt) for opt in optimizers)
    deferral = DeferredGradTransform(layers, optimizers)
    stepped: Set[int] = set()
    for opt in optimizers:
        params = {id(p) for group in opt.param_groups for p in group["params"]}
        mine = [layer for layer in layers if id(layer.weight) in params]
        deferral._stepped[id(opt)] = mine
        stepped.update(id(layer) for layer in mine)
    missing = [layer for layer in layers if id(layer) not in stepped and layer.weight.requires_grad]
    if missing:
        names = ", ".join(repr(layer.layer_name or layer._describe()) for layer in missing[:4])
        raise ValueError(
            f"defer_grad_transform: no optimizer given steps the weight of {len(missing)} whitening layer(s) "
            f"({names}): their gradients would never be transformed; pass every optimizer of the model")
    for layer in layers:
        layer.__dict__["_deferred_grad"] = True
        layer.__dict__["_deferred_q"] = None
    deferral._handles = [opt.register_step_pre_hook(deferral._pre_step) for opt in optimizers]
    return deferral
