"""Model surgery: put whitening layers into an existing model, and take them out again.

* :func:`convert_model` replaces the target convolutions of a model (by
  default every ``nn.Conv2d`` inside a residual block) with whitening layers,
  in place, in the style of ``nn.SyncBatchNorm.convert_sync_batchnorm``.
* :func:`export_model` folds the whitening back into plain ``nn.Conv2d`` /
  ``nn.Linear`` layers with identical outputs, for deployment without this
  package.
* :func:`load_plain_state_dict` / :func:`plain_state_dict` move checkpoints
  between a converted model and the unconverted architecture.
* :func:`whitening_layers` lists the whitening layers of a model.

``state_dict`` keys
-------------------
``method="grad"`` / ``"recursive"``: a target ``name`` keeps its keys
``name.weight`` (and ``name.bias``) and gains the whitening state
``name.running_mean``, ``name.running_cov``, ``name.whitening_matrix``,
``name.grad_transform``, ``name.num_blocks``, ``name._extra_state`` (the
partial block), ``name.bias_correction`` for a bias-free layer,
``name.absorbed_offset`` for a layer whose centring its BatchNorm absorbs
(``absorb_centring``, the default where the output feeds only a BatchNorm),
and for the recursive method ``name.running_cov_whitened``,
``name.running_power``, ``name.whitening_gram``.

``method="direct"``: the target ``name`` becomes a :class:`DirectWhitened`
wrapper with two children, ``whiten`` (the :class:`~whitenlayers.DirectWhiten`)
and ``layer`` (the original module, unchanged): keys ``name.weight`` become
``name.layer.weight`` and the whitening state is under ``name.whiten.*``.

A plain checkpoint (keys of the unconverted architecture) loads into a
converted model with :func:`load_plain_state_dict`, and
:func:`plain_state_dict` gives the converted model's function as a plain
checkpoint.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
import inspect
import warnings
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.fx
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .layers import DirectWhiten, GradWhitenConv2d, GradWhitenLinear, RecursiveWhitenConv2d, RecursiveWhitenLinear
from .config import EVDConfig, RecursiveConfig
from .fold import STRATEGIES, FoldCoordinator
from .stats import WhiteningStatistics

__all__ = [
    "DEFAULT_BLOCK_TYPES",
    "DirectWhitened",
    "convert_model",
    "export_model",
    "whitening_layers",
    "target_layers",
    "load_plain_state_dict",
    "plain_state_dict",
    "absorbing_batchnorms",
]

#: Class names of the residual blocks whose convolutions are converted by default.
DEFAULT_BLOCK_TYPES: Tuple[str, ...] = ("BasicBlock", "Bottleneck")

Predicate = Callable[[str, nn.Module], bool]
BlockTypes = Union[str, type, Sequence[Union[str, type]]]

_METHODS = ("grad", "recursive", "direct")
_GRAD_CLASSES = {
    "grad": (GradWhitenConv2d, GradWhitenLinear),
    "recursive": (RecursiveWhitenConv2d, RecursiveWhitenLinear),
}
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
_STATE_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class DirectWhitened(nn.Module):
    """``layer(whiten(x))``: a :class:`~whitenlayers.DirectWhiten` in front of a conv or linear layer.

    What ``convert_model(..., method="direct")`` puts in place of a target.
    ``layer`` is the original module object (same Parameters, same
    state-dict hooks); the forward/backward hooks that were registered on it
    are moved to this wrapper, so they see the same input and output as
    before the conversion.
    """

    def __init__(self, whiten: DirectWhiten, layer: nn.Module) -> None:
        super().__init__()
        self.whiten = whiten
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(self.whiten(x))


# --------------------------------------------------------------------------
# Target selection
# --------------------------------------------------------------------------
def _block_matcher(block_types: Optional[BlockTypes]) -> Callable[[nn.Module], bool]:
    if block_types is None:
        block_types = DEFAULT_BLOCK_TYPES
    if isinstance(block_types, (str, type)):
        block_types = (block_types,)
    names, classes = set(), []
    for b in block_types:
        if isinstance(b, str):
            names.add(b)
        elif isinstance(b, type):
            classes.append(b)
        else:
            raise TypeError(f"block_types must hold classes or class names, but got {b!r}")
    classes_t = tuple(classes)

    def is_block(m: nn.Module) -> bool:
        if classes_t and isinstance(m, classes_t):
            return True
        return any(c.__name__ in names for c in type(m).__mro__)

    return is_block


def _is_whitening(m: nn.Module) -> bool:
    return isinstance(m, (WhiteningStatistics, DirectWhitened))


def _candidate(m: nn.Module, include_linear: bool, exact: bool) -> bool:
    """A plain conv / linear module that a whitening layer can replace."""
    if _is_whitening(m):
        return False
    if exact:
        ok = type(m) is nn.Conv2d or (include_linear and type(m) is nn.Linear)
    else:
        ok = isinstance(m, nn.Conv2d) or (include_linear and isinstance(m, nn.Linear))
    return ok and getattr(m, "groups", 1) == 1


def _walk(model: nn.Module, visit: Callable[[nn.Module, str, nn.Module, str, bool], bool], is_block) -> None:
    """Depth-first over ``named_children``; ``visit(parent, child_name, child, qualified, in_block)``.

    ``visit`` returns True to stop descending into ``child``. Whitening layers
    and :class:`DirectWhitened` wrappers are visited but never descended into.
    Each module object is visited once even when it appears at several places.
    """
    seen = set()

    def rec(module: nn.Module, prefix: str, in_block: bool) -> None:
        for name, child in module._modules.items():
            if child is None:
                continue
            qualified = prefix + name
            stop = visit(module, name, child, qualified, in_block)
            if stop or _is_whitening(child) or id(child) in seen:
                continue
            seen.add(id(child))
            rec(child, qualified + ".", in_block or is_block(child))

    rec(model, "", is_block(model))


def target_layers(
    model: nn.Module,
    *,
    predicate: Optional[Predicate] = None,
    block_types: Optional[BlockTypes] = None,
    include_linear: bool = False,
) -> List[Tuple[str, nn.Module]]:
    """The plain layers :func:`convert_model` would replace, with their qualified names.

    See :func:`convert_model` for the rules. Whitening layers already in the
    model are not listed (they would be left alone).
    """
    if predicate is not None and block_types is not None:
        raise ValueError("pass either predicate or block_types, not both (the predicate decides alone)")
    is_block = _block_matcher(block_types)
    out: List[Tuple[str, nn.Module]] = []
    seen = set()

    def visit(parent, name, child, qualified, in_block):
        if id(child) in seen:
            return True
        if predicate is not None:
            hit = _candidate(child, include_linear, exact=False) and bool(predicate(qualified, child))
        else:
            hit = _candidate(child, include_linear, exact=True) and (
                in_block or (include_linear and isinstance(child, nn.Linear))
            )
        if hit:
            seen.add(id(child))
            out.append((qualified, child))
            return True
        return False

    _walk(model, visit, is_block)
    return out


def whitening_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The whitening layers of ``model`` (grad, recursive and :class:`~whitenlayers.DirectWhiten`) with qualified names.

    In the order of ``named_modules``. For ``method="direct"`` the names end
    in ``.whiten``.
    """
    return [(n, m) for n, m in model.named_modules() if isinstance(m, WhiteningStatistics)]


# --------------------------------------------------------------------------
# Hooks and the fold coordinator
# --------------------------------------------------------------------------
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


def _install_coordinator(model: nn.Module, strategy: str = "auto") -> Optional[FoldCoordinator]:
    layers = [m for _, m in whitening_layers(model)]
    if not layers:
        return None
    existing = _coordinators(model)
    if existing:
        coord = existing[0][1]
        coord.strategy = strategy
    else:
        coord = FoldCoordinator(strategy)
        coord.handle = model.register_forward_hook(coord)
    for layer in layers:
        layer._fold_coordinator = coord
    return coord


# --------------------------------------------------------------------------
# Centring absorbed by a following BatchNorm: which targets feed only a BatchNorm
# --------------------------------------------------------------------------
class _DataflowTracer(torch.fx.Tracer):
    """torch.fx tracer that keeps the targets (and whitening layers) as leaves, so their calls show as nodes."""

    def __init__(self, leaves: set) -> None:
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves or _is_whitening(m) or super().is_leaf_module(m, module_qualified_name)


def _absorbing_batchnorm_ok(layer: nn.Module, bn: nn.Module) -> bool:
    if isinstance(layer, nn.Conv2d):
        kinds: Tuple[type, ...] = (nn.BatchNorm2d, nn.SyncBatchNorm)
        features = layer.out_channels
    else:
        kinds = (nn.BatchNorm1d, nn.SyncBatchNorm)
        features = layer.out_features
    return (isinstance(bn, kinds) and isinstance(bn, _BatchNorm) and bn.num_features == features
            and not bn._forward_pre_hooks and not getattr(bn, "_forward_pre_hooks_with_kwargs", None))


def absorbing_batchnorms(
    model: nn.Module, targets: Sequence[Tuple[str, nn.Module]]
) -> Dict[int, Tuple[nn.Module, nn.Module]]:
    """For each target whose output feeds one BatchNorm and nothing else: ``id(target) -> (BatchNorm, its parent)``.

    The rule (conservative; anything else is left centred): the dataflow of
    the forward of the target's parent module is traced with ``torch.fx``
    (the targets kept as leaf modules; if the parent returns the target's
    output unchanged, the grandparent's forward is traced, and so on). The
    target must be called exactly once there, and its output's only user must
    be one call of a ``BatchNorm2d`` (``BatchNorm1d`` for a linear target) or
    ``SyncBatchNorm`` module with as many features, taking that output as its
    only argument and called once in that forward. The target and the
    BatchNorm must each sit at one place in the model, the target must have
    no forward hooks (they could change its output) and the BatchNorm no
    forward pre-hooks; a BatchNorm absorbs at most one target. A forward that
    ``torch.fx`` cannot trace (data-dependent control flow) absorbs nothing.
    Whether the BatchNorm is in training mode is checked at every forward by
    the layer itself, not here.
    """
    places: Dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        places[id(m)] = places.get(id(m), 0) + 1
    leaves = {id(m) for _, m in targets}
    graphs: Dict[str, Optional[torch.fx.Graph]] = {}

    def graph_of(path: str) -> Optional[torch.fx.Graph]:
        if path not in graphs:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graphs[path] = _DataflowTracer(leaves).trace(model.get_submodule(path))
            except Exception:  # untraceable forward: nothing absorbed there
                graphs[path] = None
        return graphs[path]

    found: Dict[int, Tuple[nn.Module, nn.Module]] = {}
    claims: Dict[int, int] = {}
    for name, layer in targets:
        if not name or places.get(id(layer), 0) != 1 or layer._forward_hooks:
            continue
        if getattr(layer, "_forward_hooks_with_kwargs", None) or getattr(layer, "_forward_hooks_always_called", None):
            continue
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):
            anc, rel = ".".join(parts[:depth]), ".".join(parts[depth:])
            graph = graph_of(anc)
            if graph is None:
                break
            calls = [n for n in graph.nodes if n.op == "call_module" and n.target == rel]
            if not calls:
                continue  # called from further up, or not at all
            if len(calls) > 1:
                break
            node = calls[0]
            users = list(node.users)
            if len(users) != 1:
                break
            user = users[0]
            if user.op == "output" and user.args == (node,):
                continue  # returned unchanged: its consumer is in the caller's forward
            if user.op != "call_module" or user.args != (node,) or user.kwargs:
                break
            if sum(1 for n in graph.nodes if n.op == "call_module" and n.target == user.target) != 1:
                break
            path = f"{anc}.{user.target}" if anc else str(user.target)
            bn = model.get_submodule(path)
            if places.get(id(bn), 0) == 1 and _absorbing_batchnorm_ok(layer, bn):
                found[id(layer)] = (bn, model.get_submodule(path.rpartition(".")[0]))
                claims[id(bn)] = claims.get(id(bn), 0) + 1
            break
    return {k: v for k, v in found.items() if claims[id(v[0])] == 1}


# --------------------------------------------------------------------------
# convert_model
# --------------------------------------------------------------------------
#: Layer keywords that are not whitening hyper-parameters.
_LAYER_OPTIONS = ("config", "process_group")


def _check_layer_kwargs(method: str, layer_kwargs: Dict[str, Any]) -> None:
    """``TypeError`` for a keyword the method's layers do not take (names from the config dataclasses)."""
    owner = f"convert_model(method={method!r})"
    whitening = {k: v for k, v in layer_kwargs.items() if k not in _LAYER_OPTIONS}
    if method == "direct":
        cls, exclude = DirectWhiten._CONFIG_CLASS, DirectWhiten._unused_fields
    else:
        cls, exclude = _GRAD_CLASSES[method][0]._CONFIG, ()
    cls.check_names(owner, whitening, exclude=exclude)
    config = layer_kwargs.get("config")
    if config is not None and type(config) is not cls:
        raise TypeError(f"{owner} expects config to be a {cls.__name__}, but got {type(config).__name__}")


def _make_layer(method: str, module: nn.Module, name: str, layer_kwargs: Dict[str, Any]) -> nn.Module:
    if method == "direct":
        weight = module.weight
        num = module.in_channels if isinstance(module, nn.Conv2d) else module.in_features
        whiten = DirectWhiten(num, device=weight.device, dtype=weight.dtype, **layer_kwargs)
        whiten.layer_name = f"{name}.whiten" if name else "whiten"
        new: nn.Module = DirectWhitened(whiten, module)
        new.train(module.training)
        _share_hooks(module, new, _CALL_HOOKS, move=True)
        return new
    conv_cls, lin_cls = _GRAD_CLASSES[method]
    if isinstance(module, nn.Conv2d):
        new = conv_cls.from_conv(module, **layer_kwargs)
    else:
        new = lin_cls.from_linear(module, **layer_kwargs)
    new.layer_name = name or None
    new.train(module.training)
    _share_hooks(module, new, _CALL_HOOKS + _STATE_HOOKS)
    return new


def convert_model(
    model: nn.Module,
    method: str = "grad",
    *,
    predicate: Optional[Predicate] = None,
    block_types: Optional[BlockTypes] = None,
    include_linear: bool = False,
    fold_strategy: str = "auto",
    absorb_centring: bool = True,
    **layer_kwargs: Any,
) -> nn.Module:
    """Replace the target layers of ``model`` by whitening layers, in place; returns ``model``.

    Methods:

    * ``"grad"``: each target ``nn.Conv2d`` / ``nn.Linear`` becomes a
      :class:`~whitenlayers.GradWhitenConv2d` / :class:`~whitenlayers.GradWhitenLinear`
      (EVD transform, paper section 3);
    * ``"recursive"``: :class:`~whitenlayers.RecursiveWhitenConv2d` /
      :class:`~whitenlayers.RecursiveWhitenLinear` (paper section 4);
    * ``"direct"``: the target is wrapped as ``DirectWhitened(DirectWhiten(C), target)``,
      i.e. the whitening ``y = T (x - mu)`` runs before the unchanged layer
      (features on dim 1: a wrapped ``nn.Linear`` takes ``(B, C)`` inputs).

    ``layer_kwargs`` go to every new whitening layer: the whitening
    hyper-parameters (``block_size``, ``alpha``, ``beta``, ...: the fields of
    :class:`~whitenlayers.EVDConfig` for ``grad``/``direct``, of
    :class:`~whitenlayers.RecursiveConfig` for ``recursive``), or a whole
    ``config=`` (with keywords applied on top), and ``process_group=`` (the
    group whose ranks sum their statistics at a fold; default: the world). An
    argument the method's layers do not take raises ``TypeError`` before
    anything is changed (``DirectWhiten`` has no ``beta``).

    Targets. By default every ``nn.Conv2d`` inside a module whose class (or a
    base class) is named ``BasicBlock`` or ``Bottleneck``, including the
    block's downsample / shortcut conv, and nothing else (not the stem conv,
    not the classifier): 108 layers for CIFAR ResNet-110, 52 for ResNet-50.
    ``block_types`` replaces those names (classes or class names). Only plain
    ``nn.Conv2d`` / ``nn.Linear`` are targeted by default, not subclasses (a
    subclass may override ``forward``, e.g. weight standardisation, which the
    whitening layer would silently drop). ``include_linear=True`` adds every
    plain ``nn.Linear`` of the model (e.g. the classifier) to the targets.
    ``predicate(qualified_name, module) -> bool`` overrides the rule: it is
    asked about every ``nn.Conv2d`` (and, with ``include_linear``, every
    ``nn.Linear``), subclasses included, and decides alone (passing both
    ``predicate`` and ``block_types`` is a ``ValueError``). Convolutions with
    ``groups != 1`` are never targeted (a whitening matrix couples all input
    channels; the layers reject them). A module that is already a whitening
    layer, or a wrapper from an earlier ``direct`` conversion, is left alone,
    so converting twice does not double-wrap. A module object that appears at
    several places is converted once and the new layer is put at each place.

    What is kept. The new layers share the original Parameter objects (an
    optimizer built before the conversion keeps working), so device, dtype and
    ``requires_grad`` carry over; the training flag is kept; hooks are kept:
    for ``grad``/``recursive`` the new layer takes over the original module's
    hook dictionaries (forward, forward-pre, backward and state-dict hooks;
    existing handles still remove them); for ``direct`` the call hooks move to
    the wrapper (so they see the same input and output as before) and the
    state-dict hooks stay on the wrapped layer. Each new whitening layer's
    ``layer_name`` is its qualified name (used in its error messages). At
    conversion time the whitening state is the identity (``mu = 0``,
    ``T = Q_s = I``), so the converted model computes exactly the same
    function, in train and eval mode.

    Centring absorbed by a BatchNorm (``grad`` / ``recursive``; README,
    Conventions). With ``absorb_centring=True`` (the
    default) every new layer whose output feeds a BatchNorm and nothing else
    (the rule of :func:`absorbing_batchnorms`: a ``torch.fx`` trace of the
    enclosing block's forward; in a ResNet every block conv, downsample convs
    included) gets ``layer.absorb_centring(bn)``: while that BatchNorm uses
    batch statistics the layer skips its centring offset, which the BatchNorm
    removes anyway (training unchanged up to rounding, one pass over the
    output and one backward reduction less per layer); eval mode and
    :func:`export_model` stay exact, and the export keeps the original keys
    (bias-free convs stay bias-free). ``layer.centring`` says which layers
    absorb. ``absorb_centring=False`` keeps every layer centring its input.
    Ignored for ``direct``.

    Folding. One :class:`~whitenlayers.FoldCoordinator` is registered as a
    forward hook on ``model`` and given to every whitening layer: all layers
    whose block ends during a forward fold together after the model's forward
    (one pair of coalesced collectives per block under ``torch.distributed``).
    Converting a model that already has a coordinator reuses it.
    ``fold_strategy`` says how the transforms are computed under
    ``torch.distributed``: ``"replicated"`` (every rank computes every layer),
    ``"owner"`` (each layer on one rank, results sent to all) or ``"auto"``
    (owner when the layers' summed ``M^3`` is large; see
    :func:`whitenlayers.fold.fold_layers`). Convert
    before wrapping the model in ``DistributedDataParallel`` (buffers added
    after DDP's construction would not be synchronised); passing a DDP module
    raises ``ValueError``.

    The root. A bare ``nn.Conv2d`` / ``nn.Linear`` passed as ``model`` is
    converted only if ``predicate("", model)`` selects it (the default rule
    never does: it is inside no block); the new layer is returned, and it
    folds on its own (no coordinator). Check the result with
    :func:`whitening_layers`; a warning says when nothing was converted and
    the model has no whitening layers.

    Example:
        >>> import whitenlayers as wl
        >>> model = wl.convert_model(wl.models.resnet20(), method="grad", block_size=5)
        >>> len(wl.whitening_layers(model))
        18
        >>> type(model.layer1[0].conv1).__name__, model.layer1[0].conv1.layer_name
        ('GradWhitenConv2d', 'layer1.0.conv1')
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, but got method={method!r}")
    if fold_strategy not in STRATEGIES:
        raise ValueError(f"fold_strategy must be one of {STRATEGIES}, but got fold_strategy={fold_strategy!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("convert_model: convert the model before wrapping it in DistributedDataParallel")
    _check_layer_kwargs(method, layer_kwargs)

    if predicate is not None and _candidate(model, include_linear, exact=False) and predicate("", model):
        return _make_layer(method, model, "", layer_kwargs)

    targets = target_layers(model, predicate=predicate, block_types=block_types, include_linear=include_linear)
    absorbers = absorbing_batchnorms(model, targets) if (absorb_centring and method != "direct") else {}
    # Build every new layer first, so an error leaves the model untouched.
    new_by_id: Dict[int, nn.Module] = {}
    for name, module in targets:
        new_by_id[id(module)] = _make_layer(method, module, name, layer_kwargs)
    for key, (bn, parent) in absorbers.items():
        new_by_id[key].absorb_centring(bn, parent=parent)
    if new_by_id:
        for parent in list(model.modules()):
            for child_name, child in list(parent._modules.items()):
                if child is not None and id(child) in new_by_id and not _is_whitening(parent):
                    setattr(parent, child_name, new_by_id[id(child)])
    if _install_coordinator(model, fold_strategy) is None:
        warnings.warn(
            "convert_model found no layer to convert: no plain nn.Conv2d inside a module of class "
            f"{DEFAULT_BLOCK_TYPES if block_types is None else block_types} (pass block_types or a predicate)",
            UserWarning,
            stacklevel=2,
        )
    return model


# --------------------------------------------------------------------------
# export_model
# --------------------------------------------------------------------------
def _zero_padding(conv: nn.Conv2d) -> bool:
    pad = getattr(conv, "_reversed_padding_repeated_twice", None)
    if pad is None:
        return conv.padding == "valid" or all(p == 0 for p in conv.padding)
    return all(p == 0 for p in pad)


@torch.no_grad()
def _export_direct(wrapper: DirectWhitened) -> nn.Module:
    whiten, layer = wrapper.whiten, wrapper.layer
    t = whiten.whitening_matrix.to(torch.float64)
    mu = whiten.running_mean.to(torch.float64)
    w = layer.weight
    b64 = layer.bias.to(torch.float64) if layer.bias is not None else None
    if isinstance(layer, nn.Conv2d) and not _zero_padding(layer):
        # conv(pad(T (x - mu))) != conv(pad(x)) with any constant bias at the border: keep a 1x1 whitening conv.
        pre = nn.Conv2d(whiten.num_features, whiten.num_features, 1, bias=True, device=w.device, dtype=w.dtype)
        pre.weight.copy_(t.view(t.shape[0], t.shape[1], 1, 1))
        pre.bias.copy_(-(t @ mu))
        pre.weight.requires_grad_(w.requires_grad)
        out: nn.Module = nn.Sequential(pre, layer)
    else:
        # layer(T (x - mu)) = layer(x; W T) - sum_k (W T)_k mu: exact for unpadded convs and linear layers.
        wt = torch.einsum("oi...,ij->oj...", w.to(torch.float64), t)
        offset = wt.reshape(wt.shape[0], wt.shape[1], -1).sum(-1) @ mu
        bias = (b64 if b64 is not None else torch.zeros_like(offset)) - offset
        if isinstance(layer, nn.Conv2d):
            out = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                            padding=layer.padding, dilation=layer.dilation, groups=layer.groups, bias=True,
                            padding_mode=layer.padding_mode, device=w.device, dtype=w.dtype)
        else:
            out = nn.Linear(layer.in_features, layer.out_features, bias=True, device=w.device, dtype=w.dtype)
        out.weight.copy_(wt)
        out.bias.copy_(bias)
        out.weight.requires_grad_(w.requires_grad)
        _share_hooks(layer, out, _STATE_HOOKS)
    _share_hooks(wrapper, out, _CALL_HOOKS)
    out.train(wrapper.training)
    return out


@torch.no_grad()
def _export_absorbed(layer: nn.Module) -> nn.Module:
    """A layer whose centring its BatchNorm absorbs: the plain layer with the original keys, ``s - d`` moved into
    the BatchNorm's ``running_mean`` (exact: the BatchNorm subtracts it; in training mode it removes any offset)."""
    w = layer.weight
    has_bias = layer.bias is not None
    if isinstance(layer, nn.Conv2d):
        out: nn.Module = nn.Conv2d(
            layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride, padding=layer.padding,
            dilation=layer.dilation, groups=layer.groups, bias=has_bias, padding_mode=layer.padding_mode,
            device=w.device, dtype=w.dtype,
        )
    else:
        out = nn.Linear(layer.in_features, layer.out_features, bias=has_bias, device=w.device, dtype=w.dtype)
    out.weight.copy_(w)
    out.weight.requires_grad_(w.requires_grad)
    if has_bias:
        out.bias.copy_(layer.bias)
        out.bias.requires_grad_(layer.bias.requires_grad)
    bn = layer._absorbing_bn()
    if bn.running_mean is not None:
        shift = layer._skipped_offset(w.detach().to(torch.float64)) - layer.absorbed_offset.to(torch.float64)
        bn.running_mean.copy_((bn.running_mean.to(torch.float64) - shift).to(bn.running_mean.dtype))
    out.train(layer.training)
    return out


def _export_one(module: nn.Module) -> Optional[nn.Module]:
    if isinstance(module, DirectWhitened):
        return _export_direct(module)
    if isinstance(module, (GradWhitenConv2d, GradWhitenLinear)):
        if module.centring == "absorbed" and module._absorbing_bn() is not None:
            out = _export_absorbed(module)
        elif isinstance(module, GradWhitenConv2d):
            out = module.to_conv()
        else:
            out = module.to_linear()
        _share_hooks(module, out, _CALL_HOOKS + _STATE_HOOKS)
        return out
    return None


def export_model(model: nn.Module) -> nn.Module:
    """Fold the whitening out of ``model``, in place; returns the plain model.

    * Every grad / recursive layer that centres its input becomes a plain
      ``nn.Conv2d`` / ``nn.Linear`` (:meth:`~whitenlayers.GradWhitenConv2d.to_conv`):
      same weight, the running mean folded into the bias. Outputs are
      identical; the layer always has a bias afterwards (``bias - sum_k W_k mu``,
      plus the bias compensation of a bias-free layer).
    * A grad / recursive layer whose centring a following BatchNorm absorbs
      (``layer.centring == "absorbed"``, the default of :func:`convert_model`
      where the output feeds only a BatchNorm) becomes the plain layer with
      the original's bias setting (bias-free stays bias-free), and its offset
      (``s - d``, see :meth:`~whitenlayers.GradWhitenConv2d.absorb_centring`)
      is subtracted from that BatchNorm's ``running_mean`` (computed in
      float64): exact in eval mode, and in training mode the BatchNorm
      removes any offset anyway. The export then has the state-dict keys of
      the original architecture.
    * Every ``direct`` wrapper :class:`DirectWhitened` becomes, when exact,
      one plain layer with weight ``W T`` and bias ``b - sum_k (W T)_k mu``:
      always for ``nn.Linear``, and for an ``nn.Conv2d`` without padding
      (1x1 downsample convs). A padded conv cannot absorb ``T`` and ``mu``
      (its zero border would have to be ``-T mu``), so it becomes
      ``nn.Sequential(Conv2d(C, C, 1) with weight T and bias -T mu, conv)``:
      exact, plain PyTorch, but with the extra 1x1 conv the direct method
      costs anyway. State-dict keys there are ``name.0.*`` and ``name.1.*``.
    * A bare :class:`~whitenlayers.DirectWhiten` not created by
      :func:`convert_model` is left alone.

    The new modules have new Parameters (an optimizer must be rebuilt), the
    original training flag and the call hooks of the replaced module. The
    :class:`~whitenlayers.FoldCoordinator` hooks are removed. A partial block
    and the whitening state are dropped: the export computes what the
    converted model computes in eval mode now. A whitening layer passed as
    ``model`` is returned exported.
    """
    out = _export_one(model)
    if out is not None:
        return out
    done: Dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        if _is_whitening(parent):
            continue
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in done:
                new = _export_one(child)
                if new is None:
                    continue
                done[id(child)] = new
            setattr(parent, child_name, done[id(child)])
    for m in model.modules():
        _remove_coordinators(m)
    return model


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
class _LoadResult(NamedTuple):
    missing_keys: List[str]
    unexpected_keys: List[str]


def _positions(model: nn.Module) -> Dict[str, nn.Module]:
    """Qualified name -> grad/recursive layer or DirectWhitened wrapper."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (GradWhitenConv2d, GradWhitenLinear, DirectWhitened))}


@torch.no_grad()
def _reset_to_identity(layer: WhiteningStatistics) -> None:
    """The state right after conversion: ``mu = 0``, ``T = Q_s = I``, no blocks, no bias compensation."""
    bias = getattr(layer, "bias", None)
    saved = bias.detach().clone() if isinstance(bias, Tensor) else None
    layer.reset_running_stats()
    if saved is not None:
        bias.copy_(saved)
    if getattr(layer, "bias_correction", None) is not None:
        layer.bias_correction.zero_()
    absorbed = getattr(layer, "_buffers", {}).get("absorbed_offset")
    if absorbed is not None:
        absorbed.zero_()  # the checkpoint's BatchNorm running mean is the plain model's: d = 0


def load_plain_state_dict(model: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> _LoadResult:
    """Load a checkpoint of the *unconverted* architecture into a converted ``model``.

    Keys are translated (``name.weight`` -> ``name.layer.weight`` for a
    ``direct`` wrapper; for a bias-free grad/recursive layer an incoming
    ``name.bias``, as written by :func:`plain_state_dict`, goes to its
    ``bias_correction``), every whitening layer is reset to the identity state
    of a fresh conversion (``mu = 0``, ``T = Q_s = I``, no blocks, no partial
    block), and the parameters and other buffers are loaded. The converted
    model then computes exactly what the plain model with that checkpoint
    computes. With ``strict`` a key of the checkpoint that has no place, or a
    key of the model that the checkpoint lacks (the whitening state aside),
    raises ``RuntimeError`` before anything is changed. Returns
    ``(missing_keys, unexpected_keys)`` like ``load_state_dict``.

    Example:
        >>> import torch, whitenlayers as wl
        >>> plain = wl.models.resnet20()
        >>> model = wl.convert_model(wl.models.resnet20(), method="direct")
        >>> wl.load_plain_state_dict(model, plain.state_dict())
        _LoadResult(missing_keys=[], unexpected_keys=[])
    """
    positions = _positions(model)
    translated: Dict[str, Any] = {}
    key_map: Dict[str, str] = {}
    for key, value in state_dict.items():
        new_key = key
        head, _, leaf = key.rpartition(".")
        pos = positions.get(head)
        if isinstance(pos, DirectWhitened):
            new_key = f"{head}.layer.{leaf}"
        elif pos is not None and leaf == "bias" and pos.bias is None:
            new_key = f"{head}.bias_correction"
        translated[new_key] = value
        key_map[key] = new_key
    whitening_state = set()
    for name, layer in whitening_layers(model):
        prefix = f"{name}." if name else ""
        for key in layer.state_dict().keys():
            if key not in ("weight", "bias", "bias_correction"):
                whitening_state.add(prefix + key)
        if getattr(layer, "bias_correction", None) is not None:
            whitening_state.add(prefix + "bias_correction")  # zero when the checkpoint has no bias
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        translated = OrderedDict(translated)
        translated._metadata = OrderedDict(  # type: ignore[attr-defined]
            (f"{k}.layer" if isinstance(positions.get(k), DirectWhitened) else k, v) for k, v in metadata.items()
        )
    model_keys = set(model.state_dict().keys())
    missing = sorted(k for k in model_keys - set(translated) if k not in whitening_state)
    unexpected = sorted(k for k, new_key in key_map.items() if new_key not in model_keys)
    if strict and (missing or unexpected):
        raise RuntimeError(
            "load_plain_state_dict: checkpoint does not match the model: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    for _, layer in whitening_layers(model):
        _reset_to_identity(layer)
    for key in [k for k in translated if k not in model_keys]:
        del translated[key]
    model.load_state_dict(translated, strict=False)
    return _LoadResult(missing, unexpected)


def plain_state_dict(model: nn.Module) -> Dict[str, Any]:
    """The converted ``model``'s current function as a plain checkpoint (no whitening state).

    It is ``export_model(copy.deepcopy(model)).state_dict()``: the keys of
    the unconverted architecture, with the whitening folded in (see
    :func:`export_model`). For a model converted with the default
    ``absorb_centring=True`` whose whitened layers all feed a BatchNorm (every
    ResNet), the keys are exactly the original architecture's: the checkpoint
    loads with ``strict=True`` into a fresh unconverted model, which then
    computes what the converted model computes in eval mode (the offsets are
    moved into the BatchNorms' ``running_mean``). Otherwise two differences
    from the original keys: a grad/recursive layer that centres its input
    has a ``bias`` entry (the running mean folded in; for a bias-free conv this is the only way to keep the function,
    so load such a checkpoint with :func:`load_plain_state_dict`, which puts
    it into ``bias_correction``, or into a plain model whose convs have
    biases), and a padded ``direct`` conv exports to ``name.0.*`` (the 1x1
    whitening conv) and ``name.1.*``. For layers with biases and unpadded
    ``direct`` layers, the keys are exactly the original ones.
    """
    return export_model(copy.deepcopy(model)).state_dict()
