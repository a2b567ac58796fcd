"""The weight-gradient transform as a hook on the weight instead of an autograd node per forward (opt-in).

By default a grad / recursive layer multiplies its weight gradient by ``Q_s`` in the backward, through a custom
autograd Function: a Python node in every layer's forward and backward on every step. On a GPU, where a converted
model's step is bound by the host's time, that node is one of the largest costs a layer adds.
:func:`defer_grad_transform` takes it out: the forward hands the convolution the weight itself, and one hook on
the weight (``Tensor.register_hook``, run by the backward before the gradient is accumulated into ``.grad``)
multiplies each backward's gradient by the ``Q_s`` of the forward that produced it.

Where one backward carries the gradients of several forwards of the layer with different ``Q_s`` (two forwards
per step with a fold between them), the hook alone would see only their sum: a forward that finds a forward
under another ``Q_s`` still waiting for its backward hands the convolution a view of the weight with a hook of
its own, which transforms that forward's part of the gradient apart (:meth:`_LayerDeferral.__call__`).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor, nn

from ._torch_compat import graph_break
from .functional import transform_weight_grad
from .layers import WhiteningLayer

__all__ = ["DeferredGradTransform", "defer_grad_transform"]


class _LayerDeferral:
    """One layer's deferral: the layer's forward calls it (``_weight_for_forward``) with its weight and ``Q_s``;
    its hook on the weight transforms what each backward brings.

    ``q`` is the ``Q_s`` of the layer's forwards that handed the convolution the weight itself ("direct"), and
    ``open`` says that such a forward's gradient has not reached the weight yet. A forward under the same ``Q_s``
    is direct; so is one under a new ``Q_s`` when nothing is open (the last direct forward's backward has run):
    it replaces ``q``. A forward under a new ``Q_s`` while a direct forward under another is open takes a view of
    the weight whose hook transforms its part of the gradient with its own ``Q_s``, keeps the product aside, and
    passes zeros on; the weight's hook then transforms what it receives (the direct forwards' part) with ``q`` and
    adds the parts kept aside: per forward, the default's products, summed into one gradient per backward.
    """

    __slots__ = ("weight", "patches", "layer", "q", "open", "kept", "handle")

    def __init__(self, layer: Any) -> None:
        self.weight: Tensor = layer.weight
        self.patches = getattr(layer, "features", "channels") == "patches"  # Q acts on the flattened C k^2 axis
        self.layer = weakref.ref(layer)
        self.q: Optional[Tensor] = None
        self.open = False
        self.kept: List[Tensor] = []
        self.handle = self.weight.register_hook(self._on_gradient)

    def __call__(self, w: Tensor, q: Tensor) -> Optional[Tensor]:
        """The weight the layer's forward uses; ``None``: not this deferral's weight (a ``DataParallel`` replica,
        a sharded wrapper's view, a parameter assigned since), which takes the default transform in the
        backward."""
        if w is not self.weight:
            return None
        if q is self.q:
            self.open = True
            return w
        if not self.open:
            self.q, self.open = q, True
            return w
        # a direct forward under another Q_s waits for its backward: this forward's part is transformed apart
        view = w.view_as(w)
        view.register_hook(_KeepApart(self, q))
        return view

    @graph_break  # called while dynamo traces the layer: runs eagerly (a graph break, until a recompile)
    def leave(self) -> None:
        """End the deferral of this layer for good: its forward runs inside a compiled graph, which takes the
        default transform (the autograd Function) and runs none of the deferral's Python per step; the weight's
        hook would transform that gradient a second time."""
        layer = self.layer()
        if layer is None or layer._deferral is not self:
            return
        self.handle.remove()
        layer._deferral = None
        warnings.warn(f"defer_grad_transform: {layer._describe()} runs inside a torch.compile'd graph, where the "
                      "weight-gradient transform stays in the backward (the default); its deferral is ended",
                      RuntimeWarning, stacklevel=2)

    def transform(self, grad: Tensor, q: Tensor) -> Tensor:
        if self.patches:
            return transform_weight_grad(grad.flatten(1), q).view_as(grad)
        return transform_weight_grad(grad, q)

    def _on_gradient(self, grad: Optional[Tensor]) -> Optional[Tensor]:
        """The weight's hook: the gradient one backward brings, before it is accumulated into ``.grad``."""
        self.open = False
        if grad is None:
            return None
        q = self.q
        if q is not None:
            grad = self.transform(grad, q)
        if self.kept:
            grad = sum(self.kept, grad)
            self.kept.clear()
        return grad

    _on_gradient.__torch_unserializable__ = True  # type: ignore[attr-defined]  # a model pickled with its hooks


class _KeepApart:
    """The hook on the view of the weight that one forward used under its own ``Q_s``: that forward's part of the
    gradient, transformed and kept for the weight's hook; zeros pass on to the weight."""

    __torch_unserializable__ = True
    __slots__ = ("deferral", "q")

    def __init__(self, deferral: _LayerDeferral, q: Tensor) -> None:
        self.deferral, self.q = deferral, q

    def __call__(self, grad: Tensor) -> Tensor:
        self.deferral.kept.append(self.deferral.transform(grad, self.q))
        return torch.zeros_like(grad)


class DeferredGradTransform:
    """What :func:`defer_grad_transform` returns: the deferral in force. :meth:`remove` ends it."""

    def __init__(self, layers: Sequence[WhiteningLayer], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.layers: List[WhiteningLayer] = list(layers)
        self.optimizers: List[torch.optim.Optimizer] = list(optimizers)
        self._states: List[_LayerDeferral] = [layer._deferral for layer in self.layers]

    def remove(self) -> None:
        """End the deferral: the layers put their weight through the autograd Function in each forward again. A
        forward made under the deferral whose backward has not run yet leaves its gradient untransformed if that
        backward runs later: remove the deferral after the backward (a warning says so)."""
        waiting = []
        for layer, state in zip(self.layers, self._states):
            state.handle.remove()
            if layer._deferral is state:  # (not taken over by a later deferral)
                layer._deferral = None
                if state.open:
                    waiting.append(layer)
        if waiting:
            warnings.warn(
                f"defer_grad_transform: removed while the backward of a forward made under it has not run "
                f"({len(waiting)} layer(s), first {waiting[0]._describe()}): if it runs now, those weight gradients "
                f"are not transformed; remove the deferral after the backward (after the optimizer's step)",
                RuntimeWarning, stacklevel=2)
        self.layers, self._states = [], []

    def __enter__(self) -> "DeferredGradTransform":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _sharding(model: nn.Module, layers: Sequence[Any]) -> Optional[str]:
    """What shards the layers' weights, if anything does: an FSDP1 wrapper in the model, or DTensor weights (FSDP2's
    ``fully_shard``, tensor parallelism)."""
    if any(type(module).__name__ == "FullyShardedDataParallel" for module in model.modules()):
        return "FullyShardedDataParallel"
    for layer in layers:
        if hasattr(layer.weight, "to_local"):
            return f"the weight of {layer._describe()} is a {type(layer.weight).__name__}, as fully_shard makes it"
    return None


def defer_grad_transform(model: nn.Module, *optimizers: torch.optim.Optimizer) -> DeferredGradTransform:
    """Transform the weight gradients of ``model``'s grad / recursive layers with a hook on each weight instead of
    an autograd node in each forward: the same training as the default, with less host time than a node per layer.

    By default each forward of a layer puts its weight through a Python autograd Function whose backward
    multiplies the weight gradient by ``Q_s`` (``autograd.WeightGradTransform``, a node per layer and forward). With
    the deferral the forward hands the convolution the weight itself, and a hook on the weight
    (``Tensor.register_hook``) multiplies the gradient each backward brings by the ``Q_s`` of the forward that
    produced it, before the gradient is accumulated into ``.grad``: less host time per layer than the node
    (``benchmarks/host_overhead.py``, rows ``:deferred``; ``benchmarks/RESULTS.md``).
    ``DirectWhiten`` layers are not concerned (they have no gradient transform).

    It equals the default (float64, to a few ulps: another order of the same products) wherever the default's
    products can be told apart:

    * ``.grad`` after ``backward()`` is the transformed gradient, as with the default: gradient clipping
      (``clip_grad_norm_``, ``clip_grad_value_``), logging, an optimizer wrapper that steps an inner optimizer
      (SAM), ``GradScaler``, closures (LBFGS, Lightning), DDP's all-reduce and hooks after the accumulation all see
      what they see with the default;
    * several backward passes per step (gradient accumulation) each bring their own forward's ``Q_s``, with or
      without ``accumulation_steps``;
    * several forwards in one backward (two views of a batch, a GAN's real and fake batch): a forward under the
      same ``Q_s`` as the one still waiting for its backward adds nothing; a forward under another ``Q_s`` (a fold
      fell between them) transforms its part of the gradient apart, at about the default's cost for that forward.

    What it does not equal: a forward's graph backpropagated (again, with ``retain_graph=True``, or for the first
    time) after a later forward of the same layer under another ``Q_s`` has been backpropagated takes that later
    ``Q_s``. Removing the deferral between a forward and its backward leaves that gradient untransformed (a
    warning says so). A sharded model (FSDP1's wrapper, FSDP2's ``fully_shard``) is refused: its forward uses a
    gathered copy of each weight, not the parameter. A weight that is not the parameter the deferral hooked (a
    ``DataParallel`` replica, a parameter assigned since, a parametrized weight such as ``weight_norm``'s) keeps the
    default transform. A layer traced by ``torch.compile`` leaves the deferral for good (a warning): the compiled
    graph keeps the default transform in its backward.

    Args:
        model: a model converted by :func:`~whitenlayers.convert_model`, or any module holding grad / recursive
            whitening layers.
        *optimizers: not needed (no optimizer plays a part); accepted, and checked to be optimizers or wrappers of
            one, so that code written when the transform ran at the optimizer's step keeps working.

    Returns:
        A :class:`DeferredGradTransform`; its ``remove()`` (or leaving it as a context manager) goes back to the
        autograd Function in each forward.

    Example:
        >>> import torch, whitenlayers as wl
        >>> model = torch.nn.Sequential(wl.GradWhitenLinear(4, 3))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> deferral = wl.defer_grad_transform(model)
        >>> model(torch.randn(8, 4)).square().sum().backward()  # .grad is the transformed gradient
        >>> opt.step()
        >>> deferral.remove()
    """
    layers: List[Any] = [m for m in model.modules() if isinstance(m, WhiteningLayer) and "grad_transform" in m._buffers]
    if not layers:
        raise ValueError(f"defer_grad_transform: {type(model).__name__} has no grad or recursive whitening layer")
    sharding = _sharding(model, layers)
    if sharding is not None:
        raise ValueError(
            f"defer_grad_transform: {type(model).__name__} is sharded ({sharding}): its forward uses a gathered "
            f"copy of each weight, not the parameter, so the deferral cannot hook it; use the default transform in "
            f"the backward, which transforms each gradient before it is sharded")
    # Each optimizer a torch.optim.Optimizer, or anything that steps like one (a wrapper such as Accelerate's
    # AcceleratedOptimizer, Lightning's LightningOptimizer, a SAM implementation): the deferral does not use it, but
    # an argument that is no optimizer at all (a learning rate, a model) is a mistake.
    for optimizer in optimizers:
        if not (isinstance(optimizer, torch.optim.Optimizer) or (callable(getattr(optimizer, "step", None))
                                                                 and hasattr(optimizer, "param_groups"))):
            raise TypeError(
                f"defer_grad_transform: expected optimizers (torch.optim.Optimizer, or a wrapper of one with `step` "
                f"and `param_groups`) after the model, but got {type(optimizer).__name__}; no optimizer is needed")
    # a frozen weight: nothing to hook; a parametrized one (weight_norm, ...): computed anew in each forward
    deferred = [layer for layer in layers if layer.weight.requires_grad and layer.weight.is_leaf]
    for layer in deferred:
        earlier = layer._deferral
        if earlier is not None:  # deferred already: this deferral takes the layer over
            earlier.handle.remove()
        state = layer._deferral = _LayerDeferral(layer)
        if earlier is not None and earlier.weight is state.weight:
            state.q, state.open, state.kept = earlier.q, earlier.open, earlier.kept
    return DeferredGradTransform(deferred, optimizers)
